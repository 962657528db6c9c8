"""[TOnICS] ontology-bucketed curriculum minibatches: one training row per aligned class (``rows``, over the
ontology of ``rayvl.methods.tonics.ontology``, which the contextual evaluation shares), the per-worker bucket sampler and the
curriculum (``sampler``, ``train``); ``check``: the config constraints."""
