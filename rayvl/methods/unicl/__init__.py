"""[UniCL] image-text-label contrastive learning: image-label data as class prompts (``rows``), label-aware targets,
balanced mixing and the class-embedding baseline (``train``); ``check``: the config constraints."""
