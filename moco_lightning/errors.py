"""The library's error types for bad input: a setting or a file that is wrong, with a message saying which and
what to do. The command line prints these as one ``error:`` line (exit code 2) instead of a traceback."""


class ConfigError(ValueError):
    """A constructor argument, a combination of settings or an input that cannot work."""


class DataNotFoundError(ConfigError, FileNotFoundError):
    """A dataset, folder or checkpoint that is not where the settings say."""
