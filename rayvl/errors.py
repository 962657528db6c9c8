"""The errors rayvl raises for what a user can fix, apart from the modules that raise them: the methods' config checks
(``rayvl.methods.<method>.check``, which ``rayvl.config`` runs) raise ConfigError without importing the config, and
the data plane's readers raise DataPlaneError with or without Ray (``rayvl.data.report`` is Ray's side)."""


class ConfigError(ValueError):
    """A config key is unknown, mistyped or conflicts with another key."""


class DataPlaneError(RuntimeError):
    """The data path cannot produce training data (no shards, every sample dropped, a starved pipeline)."""
