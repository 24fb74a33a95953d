"""The error for a bad input refused before any work: a ValueError whose message names the field, file or folder
and the fix (`jtrainer train` prints it as one line and exits with code 1)."""


class BadInput(ValueError):
    """A config value, data file, model file or output folder that cannot work."""
