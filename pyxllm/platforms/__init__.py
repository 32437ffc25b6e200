"""Device platforms: detection, and binding of the platform's kernels.

Device branches live here (and in the executor's choice of attention backend and runner),
nowhere else.
"""
from __future__ import annotations

from pyxllm import kernels
from pyxllm.platforms.cpu import CPU_PLATFORM
from pyxllm.platforms.interface import Platform

_PLATFORMS: dict[str, Platform] = {"cpu": CPU_PLATFORM}
_current: Platform | None = None


def resolve_platform(device: str) -> Platform:
    """The platform for a ``--device`` value (``auto`` picks the best one installed).

    Raises:
        ValueError: an unknown or unavailable device, naming the supported ones.
    """
    if device == "auto":
        return CPU_PLATFORM
    if device not in _PLATFORMS:
        raise ValueError(f"--device: unsupported device {device!r}; supported: {', '.join(['auto', *_PLATFORMS])}")
    return _PLATFORMS[device]


def set_current_platform(platform: Platform) -> Platform:
    """Make ``platform`` the active one and bind its kernels to ``pyxllm.kernels.ops``."""
    global _current
    kernels.bind(platform.kernels_module)
    _current = platform
    return platform


def current_platform() -> Platform:
    """The active platform (CPU until another one is set)."""
    return _current or set_current_platform(CPU_PLATFORM)
