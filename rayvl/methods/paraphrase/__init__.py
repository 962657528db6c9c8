"""[Paraphrase] text strategies and alignment layers (``text_strategies``) and the paraphrase rank-similarity
metrics (``metrics``); ``check``: the config constraints."""
