"""Device platforms: detection, and binding of the platform's kernels.

Device branches live here (and in the executor's choice of attention backend and runner),
nowhere else. ``--device auto`` picks CUDA, then NPU (``torch_npu``), then MLU (``torch_mlu``),
else the CPU; a device asked for by name whose package is missing fails at start-up with one
message naming the package and its install command.
"""

from __future__ import annotations

import importlib

from pyxllm import kernels
from pyxllm.config import DEVICES, PLATFORMS
from pyxllm.platforms import cpu
from pyxllm.platforms.interface import Platform, PlatformUnavailableError

# ``PLATFORMS`` lists the CPU first: ``auto``'s fallback, after the accelerators
FALLBACK, AUTO_ORDER = PLATFORMS[0], PLATFORMS[1:]

_current: Platform | None = None

__all__ = [
    "AUTO_ORDER",
    "Platform",
    "PlatformUnavailableError",
    "current_platform",
    "detect_device",
    "platform_module",
    "resolve_platform",
    "set_current_platform",
]


def platform_module(device: str):
    """The module of a platform named in ``pyxllm.config.PLATFORMS``: its ``is_available()``
    and ``load() -> Platform``, and for ``pyxllm env`` its ``PACKAGE`` (the importable package
    that provides it), ``SHARED_LIBRARIES`` (name prefixes of its shared libraries) and
    ``ENV_PREFIXES`` (of the environment variables that steer it); imports no device
    package."""
    return importlib.import_module(f"{__name__}.{device}")


def detect_device() -> str:
    """The best device present: the first of ``AUTO_ORDER`` that is available, else ``cpu``."""
    for name in AUTO_ORDER:
        if platform_module(name).is_available():
            return name
    return FALLBACK


def resolve_platform(device: str) -> Platform:
    """The platform for a ``--device`` value (``auto`` picks the best one present).

    Raises:
        ValueError: an unknown device, naming the supported ones.
        PlatformUnavailableError: (a ``ValueError``) the device's package is not installed or it
            sees no card; the message names the package and its install command.
    """
    if device == "auto":
        device = detect_device()
    if device not in PLATFORMS:
        raise ValueError(
            f"--device: unsupported device {device!r}; supported: {', '.join(DEVICES)}"
        )
    return platform_module(device).load()


def set_current_platform(platform: Platform) -> Platform:
    """Make ``platform`` the active one and bind its kernels to ``pyxllm.kernels.ops``."""
    global _current
    kernels.bind(platform.kernels_module)
    _current = platform
    return platform


def current_platform() -> Platform:
    """The active platform (CPU until another one is set)."""
    return _current or set_current_platform(cpu.load())
