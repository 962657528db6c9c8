"""The search spaces, installed with rayvl as the package ``rayvl.tune_spaces`` (pyproject.toml)."""
