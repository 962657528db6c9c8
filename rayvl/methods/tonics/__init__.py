"""[TOnICS] ontology-bucketed curriculum minibatches: the ontology of object classes over caption nouns
(``ontology``), one training row per aligned class (``rows``), the per-worker bucket sampler and the curriculum
(``sampler``, ``train``); ``check``: the config constraints."""
