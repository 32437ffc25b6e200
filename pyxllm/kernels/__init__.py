"""Stateless compute kernels, bound once to the active platform's implementation.

Layers call ``kernels.ops.<name>(...)``; ``platforms`` binds ``ops`` to the kernel package of the
chosen device (``pyxllm.kernels.cpu`` on CPU). Before any binding, ``ops`` is the pure-PyTorch
reference implementation in ``pyxllm.kernels.native``, the fallback every platform can use.

Importing a kernel package does no work beyond importing; a package that must build or load
something first (the CPU's fused kernels) does it in its ``on_bind()`` hook, which :func:`bind`
calls.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from pyxllm.kernels import native

ops: ModuleType = native


def bind(module_name: str) -> ModuleType:
    """Make ``kernels.ops`` the kernel package ``module_name`` (after calling its ``on_bind()``,
    if it has one) and return it.

    Raises:
        ImportError: the package (or a device library it needs) is not installed.
    """
    global ops
    module = importlib.import_module(module_name)
    on_bind = getattr(module, "on_bind", None)
    if on_bind is not None:
        on_bind()
    ops = module
    return ops
