"""The error every config raises for a value that cannot work."""


class ConfigError(ValueError):
    """A configuration that cannot work; the message says why in one line."""
