"""Platforms provided by a PyTorch adapter package (Ascend's ``torch_npu``, Cambricon's
``torch_mlu``): one recipe, with each package's messages as data.

Importing such a package adds the device to torch (``torch.npu``, ``torch.mlu``); until then
torch does not know it. So the platform is available when the package is installed and, once
imported, sees a card; asked for by name without it, it fails naming the package and how to
install it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from pyxllm.platforms import interface
from pyxllm.platforms.interface import Platform, PlatformUnavailableError


@dataclass(frozen=True, slots=True)
class AdapterPackage:
    """The adapter package that provides ``platform``.

    Attributes:
        platform: the platform the package provides.
        package: its importable name (``torch_npu``).
        description: what it is, for the missing-package message ("Ascend's PyTorch adapter").
        install: how to install it; ``{release}`` stands for the installed torch's release.
        no_card_checks: what to check when it sees no card (the message's end, after "check ").
    """

    platform: Platform
    package: str
    description: str
    install: str
    no_card_checks: str

    def is_available(self) -> bool:
        """Whether the package is installed and sees at least one card (imports it if
        installed)."""
        if not interface.package_installed(self.package):
            return False
        importlib.import_module(self.package)
        return self.platform.device_module().is_available()

    def load(self) -> Platform:
        """The platform.

        Raises:
            PlatformUnavailableError: the package is not installed (naming the install command
                for this torch) or sees no card (naming what to check).
        """
        name = self.platform.name
        if not interface.package_installed(self.package):
            install = self.install.format(release=interface.torch_release())
            raise PlatformUnavailableError(
                f"device {name} needs {self.package} ({self.description}), which is not "
                f"installed; {install}"
            )
        if not self.is_available():
            raise PlatformUnavailableError(
                f"device {name}: {self.package} sees no {name.upper()}; check {self.no_card_checks}"
            )
        return self.platform
