"""How pseudo-BoW captions are told apart from written ones ([BoW] §2.3): BoW trains them as they are and keeps them
out of its statistics (rayvl.methods.bow.deformation)."""

PSEUDO_FLAG = "pseudo_bow"  # in a sample's JSON: its caption is a pseudo-BoW caption (rayvl.methods.bow.pseudo_label)
PSEUDO_MARKER = "pseudo_label.json"  # in a `rayvl pseudo-label` output folder, beside its <rule>/ shard folders
