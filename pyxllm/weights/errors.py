"""The one error type of model loading."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model could not be found, read or understood.

    Raised for every loading problem (missing path, unsupported file type or architecture,
    missing or corrupt weight files). The message names the file and the problem, and says
    how to fix it; it is meant to be shown to the user as is.
    """
