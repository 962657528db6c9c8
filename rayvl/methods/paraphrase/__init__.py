"""[Paraphrase]: the config constraints of its text strategies and metrics (``check``). The strategies themselves
are model structure (``rayvl.models.text_strategies``), the rank-similarity metrics evaluation
(``rayvl.eval.paraphrase``): the core uses both."""
