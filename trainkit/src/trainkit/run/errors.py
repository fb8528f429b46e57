"""The one error type the command line reports as a single line (exit status 2) instead of a traceback."""


class ConfigError(ValueError):
    """Bad input the user can fix: a setting, a platform variable, a data directory or a checkpoint path."""
