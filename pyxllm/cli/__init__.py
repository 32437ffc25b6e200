"""The ``pyxllm`` command line, at the top of the stack: nothing else imports it."""
