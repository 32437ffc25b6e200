"""Model definitions; ``registry`` maps a config's ``architectures`` to a class."""
