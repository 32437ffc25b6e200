"""The error of multi-process runs (no torch import: the CLI catches it)."""


class DistributedError(RuntimeError):
    """Ranks could not be joined, or a rank died; the message names the rank and what to check."""
