"""The error a user's configuration causes, apart from ``rayvl.config`` so that the methods' config checks
(``rayvl.methods.<method>.check``, which ``rayvl.config`` runs) can raise it without importing the config."""


class ConfigError(ValueError):
    """A config key is unknown, mistyped or conflicts with another key."""
