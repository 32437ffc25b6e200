"""Where pyxllm's log lines go when the program running it has not said.

vLLM's answer (``VLLM_CONFIGURE_LOGGING``, on by default): its own INFO lines reach stderr from
``vllm serve`` and from ``LLM(...)`` in a script alike. Ours is the same, with one difference: a
program that configured logging itself (a handler on the root logger or on ``pyxllm``) keeps
its configuration, so nothing is printed twice. ``PYXLLM_CONFIGURE_LOGGING=0`` turns it off.
"""

from __future__ import annotations

import logging
import os

FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def ensure_logging() -> None:
    """Send the ``pyxllm`` logger's INFO lines to stderr (:data:`FORMAT`), unless logging is
    configured already or ``PYXLLM_CONFIGURE_LOGGING`` is ``0``."""
    if os.environ.get("PYXLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    root, ours = logging.getLogger(), logging.getLogger("pyxllm")
    if not root.handlers and not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
