"""The one error of this package (its own module: the readers raise it and `extract` re-raises it named)."""


class ExtractError(ValueError):
    """A file that cannot be ingested; the message names the file and why."""
