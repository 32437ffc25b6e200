"""``/tokenize`` and ``/detokenize``."""
