"""Stateless compute kernels, bound once to the active platform's implementation.

Layers call ``kernels.ops.<name>(...)``; ``platforms`` binds ``ops`` to the kernel package of the
chosen device (``pyxllm.kernels.cpu`` on CPU). Before any binding, ``ops`` is the pure-PyTorch
reference implementation in ``pyxllm.kernels.native``, the fallback every platform can use.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from pyxllm.kernels import native

ops: ModuleType = native


def bind(module_name: str) -> ModuleType:
    """Make ``kernels.ops`` the kernel package ``module_name`` and return it.

    Raises:
        ImportError: the package (or a device library it needs) is not installed.
    """
    global ops
    ops = importlib.import_module(module_name)
    return ops
