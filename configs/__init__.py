"""The recipes, installed with rayvl as the package ``rayvl.configs`` (pyproject.toml)."""
