"""What this process runs on, for ``pyxllm env``: each device platform's package and the shared
libraries of it that are actually loaded, torch's build, and the CPU's features and fused kernels.

Loaded libraries are read from ``/proc/<pid>/maps`` (what the dynamic loader mapped, so the copy
that runs, not the one meant to run). The copies of one library on the search path are the
files of the same name in the directories of ``$LD_LIBRARY_PATH``, the directory each loaded
copy came from and the package's directory in every ``sys.path`` entry; two different files
there (Ascend's two ``libtorch_npu.so``, a system CUDA runtime beside the wheel's) mean the
loader may take the wrong one, so they are reported. The system's ``ldconfig`` cache is not
searched: a bundled OpenMP or C++ runtime beside the system's is normal.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform as host
import re
import sys
from dataclasses import asdict, dataclass, field

import torch

from pyxllm.config import PLATFORMS
from pyxllm.kernels.cpu import build as kernel_build
from pyxllm.kernels.cpu.features import KEY_FEATURES, cpu_flags, cpu_model_name
from pyxllm.platforms import platform_module
from pyxllm.platforms.cpu import cpu_default_dtype

MAPS = "/proc/self/maps"
# torch's own libraries, by name (a stray copy outside torch's directory is one of them)
_TORCH_LIBRARIES = ("libtorch", "libc10", "libshm")
# environment variables shown besides each platform's ``ENV_PREFIXES`` (names starting so),
# and the names whose values are hidden
ENV_PREFIXES = (
    "PYXLLM_",
    "TORCH_",
    "PYTORCH_",
    "HF_",
    "TRANSFORMERS_",
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",
)
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASS|CREDENTIAL", re.IGNORECASE)
__all__ = [
    "PlatformEnvironment",
    "all_platforms",
    "cpu_environment",
    "environment_variables",
    "library_copies",
    "loaded_libraries",
    "platform_environment",
    "torch_environment",
]


def _is_shared_library(path: str) -> bool:
    name = os.path.basename(path)
    return name.endswith(".so") or ".so." in name


def loaded_libraries(maps_path: str = MAPS) -> list[str]:
    """Paths of the shared libraries mapped into this process (``maps_path``: its
    ``/proc/<pid>/maps``), in the order first mapped, each once; ``[]`` where the file cannot
    be read (no ``/proc``)."""
    seen: dict[str, None] = {}
    try:
        with open(maps_path) as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if path.startswith("/") and _is_shared_library(path):
                        seen.setdefault(path, None)
    except OSError:
        return []
    return list(seen)


def _package_dirs(package: str) -> list[str]:
    """``<entry>/<package>`` and its ``lib`` for every ``sys.path`` entry that has the package
    (an install that shadows another is one of them)."""
    dirs = []
    for entry in sys.path:
        root = os.path.join(entry or ".", package)
        dirs += [d for d in (root, os.path.join(root, "lib")) if os.path.isdir(d)]
    return dirs


def library_copies(
    names: list[str], loaded: list[str], extra_dirs: list[str], environ=os.environ
) -> dict[str, list[str]]:
    """The library names of ``names`` with more than one distinct file on the search path.

    Args:
        names: file names (``libtorch_npu.so``).
        loaded: the loaded libraries' paths (each copy's directory is searched, and a loaded
            copy is listed first).
        extra_dirs: more directories to search (the package's).
        environ: where ``LD_LIBRARY_PATH`` is read.
    Returns:
        ``{name: [path, ...]}``, two or more paths each, files told apart by device and inode
        (a symbolic or hard link to the same file is one copy).
    """
    dirs = [d for d in environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    dirs += [os.path.dirname(path) for path in loaded] + extra_dirs
    copies = {}
    for name in dict.fromkeys(names):
        found: dict[tuple[int, int], str] = {}
        candidates = [p for p in loaded if os.path.basename(p) == name]
        candidates += [os.path.join(d, name) for d in dict.fromkeys(dirs)]
        for path in candidates:
            try:
                stat = os.stat(path)
            except OSError:
                continue
            found.setdefault((stat.st_dev, stat.st_ino), os.path.abspath(path))
        if len(found) > 1:
            copies[name] = list(found.values())
    return copies


@dataclass(slots=True)
class PlatformEnvironment:
    """One device platform as this process sees it.

    Attributes:
        name: the ``--device`` spelling.
        package: the importable package that provides it (``torch``, ``torch_npu``).
        installed: whether the package can be found.
        imported: whether importing it worked; ``import_error`` says why not.
        version: the package's version (``__version__``, else its distribution's).
        available: whether the platform sees a device (``is_available()``); ``None`` when its
            package does not import.
        devices: the names of the devices it sees (accelerators only).
        libraries: paths of its shared libraries loaded in this process: names starting with
            one of the platform's ``SHARED_LIBRARIES``, and (for a package other than torch,
            whose own are torch's) those in the package's directory.
        copies: library names with more than one copy on the search path (see
            :func:`library_copies`), each with its paths.
    """

    name: str
    package: str
    installed: bool
    imported: bool = False
    import_error: str | None = None
    version: str | None = None
    available: bool | None = None
    devices: list[str] = field(default_factory=list)
    libraries: list[str] = field(default_factory=list)
    copies: dict[str, list[str]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        """The fields as a JSON-ready dict."""
        return asdict(self)


def _version(module, package: str) -> str | None:
    version = getattr(module, "__version__", None)
    if version is not None:
        return str(version)
    try:
        return importlib.metadata.version(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return None


def _devices(module) -> list[str]:
    """Names of the cards an accelerator platform sees."""
    platform = module.load()
    device_module = platform.device_module()
    if device_module is None:
        return []
    count = device_module.device_count()
    name = getattr(device_module, "get_device_name", None)
    return [str(name(i)) if name else f"{platform.name}:{i}" for i in range(count)]


def _probe(name: str) -> PlatformEnvironment:
    """Platform ``name``'s package: installed, imported (importing it), version, devices."""
    module = platform_module(name)
    package = module.PACKAGE
    env = PlatformEnvironment(
        name=name, package=package, installed=importlib.util.find_spec(package) is not None
    )
    if not env.installed:
        return env
    try:
        imported = importlib.import_module(package)
    except Exception as exc:  # noqa: BLE001 - an adapter's import can fail any way
        env.import_error = f"{type(exc).__name__}: {exc}"
        return env
    env.imported = True
    env.version = _version(imported, package)
    try:
        env.available = bool(module.is_available())
        if env.available and name != "cpu":
            env.devices = _devices(module)
    except Exception as exc:  # noqa: BLE001 - a driver error is what env must show
        env.import_error = f"{type(exc).__name__}: {exc}"
    return env


def _add_libraries(env: PlatformEnvironment, loaded: list[str]) -> None:
    """Fill ``env.libraries`` from ``loaded`` and ``env.copies`` from the search path."""
    prefixes = platform_module(env.name).SHARED_LIBRARIES
    package_dirs = _package_dirs(env.package) if env.package != "torch" else []
    own = tuple(d + os.sep for d in package_dirs)
    env.libraries = [
        path
        for path in loaded
        if os.path.basename(path).startswith(prefixes) or path.startswith(own)
    ]
    names = [os.path.basename(p) for p in env.libraries]
    for directory in package_dirs:  # the package's own, loaded or not (its import may fail)
        names += sorted(n for n in os.listdir(directory) if _is_shared_library(n))
    env.copies = library_copies(names, env.libraries, package_dirs)


def platform_environment(name: str) -> PlatformEnvironment:
    """Import platform ``name``'s package (when installed), then report it (see
    :class:`PlatformEnvironment`); an import or device query that fails is reported in
    ``import_error``, not raised."""
    env = _probe(name)
    _add_libraries(env, loaded_libraries())
    return env


def all_platforms() -> list[PlatformEnvironment]:
    """:func:`platform_environment` of every platform in ``pyxllm.config.PLATFORMS``, their
    libraries read once all packages are imported."""
    envs = [_probe(name) for name in PLATFORMS]
    loaded = loaded_libraries()
    for env in envs:
        _add_libraries(env, loaded)
    return envs


def environment_variables(environ=os.environ) -> dict[str, str]:
    """The variables that change what pyxllm, torch or a platform does (:data:`ENV_PREFIXES`
    and every platform's), sorted by name; the values of those named like secrets (``KEY``,
    ``TOKEN``, ``PASS`` ...) read ``<hidden>``."""
    prefixes = ENV_PREFIXES + tuple(
        prefix for name in PLATFORMS for prefix in platform_module(name).ENV_PREFIXES
    )
    return {
        name: "<hidden>" if _SECRET.search(name) else value
        for name, value in sorted(environ.items())
        if name.startswith(prefixes)
    }


def _torch_dirs() -> list[str]:
    """torch's package directory and the ``torch.libs`` beside it (libraries a wheel bundles)."""
    root = os.path.dirname(torch.__file__)
    return [d for d in (root, root.rstrip(os.sep) + ".libs") if os.path.isdir(d)]


def torch_environment() -> dict:
    """torch's version, location and build: ``build`` (``CPU``, ``CUDA 12.8``, ``ROCm 6.3``),
    ``cuda``, ``hip``, ``cudnn``, ``debug``, ``cxx11_abi``, ``git_version``, ``parallel_backend``
    (ATen's: OpenMP, native); ``libraries``: the loaded libraries from torch's directories and
    those named as torch's (``libtorch*``, ``libc10*``) wherever they came from; ``copies``:
    those with more than one copy on the search path."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if torch.version.hip:
        build = f"ROCm {torch.version.hip}"
    elif torch.version.cuda:
        build = f"CUDA {torch.version.cuda}"
    else:
        build = "CPU"
    backend = next(
        (
            line.partition(":")[2].strip()
            for line in torch.__config__.parallel_info().splitlines()
            if line.startswith("ATen parallel backend")
        ),
        None,
    )
    dirs = tuple(d + os.sep for d in _torch_dirs())
    libraries = [
        path
        for path in loaded_libraries()
        if path.startswith(dirs) or os.path.basename(path).startswith(_TORCH_LIBRARIES)
    ]
    names = [os.path.basename(path) for path in libraries]
    return {
        "version": torch.__version__,
        "location": os.path.dirname(torch.__file__),
        "build": build,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "cudnn": cudnn,
        "debug": bool(torch.version.debug),
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "git_version": torch.version.git_version,
        "parallel_backend": backend,
        "libraries": libraries,
        "copies": library_copies(names, libraries, _package_dirs("torch")),
    }


def cpu_environment() -> dict:
    """The CPU as pyxllm sees it: ``model``, ``machine``, ``features`` (each of
    ``KEY_FEATURES`` -> present), ``torch_capability`` (the vector ISA torch's kernels
    dispatch to: ``AVX512``, ``AVX2``, ...), ``default_dtype`` (what ``--dtype auto`` means
    here for a checkpoint without a dtype, or the error of a bad
    ``$PYXLLM_CPU_DEFAULT_DTYPE``), ``fused_kernels``
    (``pyxllm.kernels.cpu.build.build_status``)."""
    flags = cpu_flags()
    try:
        default_dtype = str(cpu_default_dtype()).removeprefix("torch.")
    except ValueError as exc:
        default_dtype = f"error: {exc}"
    return {
        "model": cpu_model_name(),
        "machine": host.machine(),
        "features": {name: name in flags for name in KEY_FEATURES},
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "default_dtype": default_dtype,
        "fused_kernels": kernel_build.build_status(),
    }
