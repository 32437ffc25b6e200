"""Completions (``/v1/completions``)."""
