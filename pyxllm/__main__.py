"""``python -m pyxllm``: the same as the ``pyxllm`` command."""

import sys

from pyxllm.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
