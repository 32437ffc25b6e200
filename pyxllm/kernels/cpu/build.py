"""Building and loading the fused CPU kernels' library (``csrc/*.cpp``) with PyTorch's C++
extension loader (g++ and ninja, 15-60 s on 2 cores).

The build is cached under torch's extension root (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) in a directory named by a digest of the CPU's feature flags,
Python's and torch's versions, torch's location and the sources' contents, into which the
sources are copied before compiling. So each version of the sources is built once per machine
and environment, whichever checkout of pyxllm loads it first: keyed by name only (torch's
cache) and compiled from each checkout's own path (which ninja sees as a change), a clean clone
and a working tree, or two branches, rebuilt over each other on every load (~35 s each), and a
checkout with other sources could load a build without its kernels.

The log says whether a load built the kernels or took the cached build, and how long it took.
Concurrent first loads wait on torch's lock file (``lock`` in the build directory); a build
that was killed leaves it behind, and torch would wait on it for ever, so a load that finds it
logs its path and gives up once the lock is ``PYXLLM_CPU_KERNELS_LOCK_TIMEOUT`` seconds old
(default 600; a build takes about a minute).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from pyxllm.kernels.cpu.features import cpu_feature_line

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).parent / "csrc" / name
    for name in ("cpu_kernels.cpp", "group_linear.cpp", "bf16_linear.cpp")
)
MODE_ENV = "PYXLLM_CPU_KERNELS"
LOCK_TIMEOUT_ENV = "PYXLLM_CPU_KERNELS_LOCK_TIMEOUT"
ARCH_ENV = "PYXLLM_CPU_KERNELS_ARCH"
# the x86-64 levels the kernels can be built for instead of the host's own (``native``), from
# the oldest: x86-64-v2 runs their plain vector code, v3 their AVX2 branches, v4 AVX-512
X86_LEVELS = ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4")


def target_arch() -> str:
    """The ``-march`` the kernels are built for: ``$PYXLLM_CPU_KERNELS_ARCH`` (``native``, the
    default, or one of :data:`X86_LEVELS` on x86-64), so that every ISA branch of the kernels
    can be built and tested on a CPU that runs it, not only the host's best.

    Raises:
        ValueError: a value the host cannot take, naming the variable and the choices.
    """
    arch = os.environ.get(ARCH_ENV, "native") or "native"
    choices = ("native", *X86_LEVELS) if platform.machine() == "x86_64" else ("native",)
    if arch not in choices:
        raise ValueError(f"{ARCH_ENV}={arch!r}: must be one of {', '.join(choices)}")
    return arch


def compile_flags() -> tuple[list[str], list[str]]:
    """``(extra_cflags, extra_ldflags)``.

    ``-ffp-contract=off`` keeps float32 results equal to the reference's where the arithmetic is
    the same (no fused multiply-add), and a row's result the same in every instantiation of a
    kernel's row-count templates (contraction chosen per instantiation made ``int4_linear``'s
    rows differ in their last bits between a one-row decode and an eight-row verification).
    On x86-64/aarch64 Linux: ``-march=native`` (the build's name keys the CPU's feature flags, so
    a home directory shared by different CPUs keeps one build each; :func:`target_arch` may
    name an older level instead) and ``-fopenmp``, without
    which ``at::parallel_for`` runs on one thread (the library resolves to the ``libgomp.so.1``
    torch already loaded, so there is one OpenMP runtime).
    """
    flags = ["-O3", "-ffp-contract=off", "-fno-trapping-math"]
    if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64"):
        return [*flags, f"-march={target_arch()}", "-fopenmp"], ["-fopenmp"]
    return flags, []


def extension_name() -> str:
    """``pyxllm_cpu_kernels_<digest>``: the digest of the CPU's feature flags, the compile
    flags, Python's and torch's versions, torch's location (its headers' include path, which
    ninja sees as part of each command: two environments sharing one build rebuilt it in turn)
    and the sources' contents."""
    digest = hashlib.sha1(
        f"{cpu_feature_line()} {compile_flags()} {sys.version} {torch.__version__} "
        f"{torch.__file__}".encode()
    )
    for source in SOURCES:
        digest.update(source.read_bytes())
    return f"pyxllm_cpu_kernels_{digest.hexdigest()[:12]}"


def build_directory(name: str) -> Path:
    """Where extension ``name`` is built: under ``$TORCH_EXTENSIONS_DIR``, else torch's default
    extension root (not created here)."""
    # lazy: cpp_extension takes ~0.15 s to import, and only a build or `pyxllm env` needs it
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name


def stage_sources(directory: Path) -> list[str]:
    """Copy :data:`SOURCES` into ``directory/src`` (each written whole, then renamed, so a
    concurrent load sees all of a file or none) and return the copies' paths."""
    (directory / "src").mkdir(parents=True, exist_ok=True)
    copies = []
    for source in SOURCES:
        copy = directory / "src" / source.name
        if not copy.exists():
            partial = copy.with_suffix(f".{os.getpid()}.tmp")
            partial.write_bytes(source.read_bytes())
            partial.replace(copy)
        copies.append(str(copy))
    return copies


def build_status() -> dict[str, str | None]:
    """What a load would find, without building, loading or creating anything (``pyxllm env``).

    Returns:
        ``mode``: ``fused`` or ``native`` (``$PYXLLM_CPU_KERNELS``); ``name``: the extension's
        name; ``cache_dir``: its build directory; ``library``: the built ``.so`` there, ``None``
        before the first build; ``compiler``: the C++ compiler torch would run (``$CXX``, else
        ``c++``) as found on ``$PATH``, ``None`` when it is not there; ``arch``: the ``-march``
        they are built for (:func:`target_arch`); ``status``: ``built``, ``not built`` (these
        sources were not built here yet), ``disabled``, or the error of a bad ``arch``.
    """
    from torch.utils.cpp_extension import get_cxx_compiler  # lazy: see build_directory

    disabled = os.environ.get(MODE_ENV, "fused") == "native"
    compiler = shutil.which(get_cxx_compiler())
    try:
        arch = target_arch()
    except ValueError as e:
        arch = os.environ.get(ARCH_ENV, "")
        status = {"status": str(e), "name": None, "cache_dir": None, "library": None}
        return {
            "mode": "native" if disabled else "fused",
            "arch": arch,
            "compiler": compiler,
        } | status
    name = extension_name()
    directory = build_directory(name)
    library = directory / f"{name}.so"
    built = library.is_file()
    return {
        "mode": "native" if disabled else "fused",
        "status": "disabled" if disabled else "built" if built else "not built",
        "arch": arch,
        "name": name,
        "cache_dir": str(directory),
        "library": str(library) if built else None,
        "compiler": compiler,
    }


def wait_for_build_lock(lock: Path, timeout: float, poll: float = 0.5) -> None:
    """Wait while ``lock`` (torch's build lock file) exists, logging its path once.

    Raises:
        TimeoutError: the lock is ``timeout`` seconds old or more (its mtime): a build that was
            killed left it, or a build runs that long; the message names the file.
    """
    logged = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age >= timeout:
            raise TimeoutError(
                f"the build lock {lock} is {age:.0f} s old: a build that was killed left it "
                f"behind (delete it if no build is running; {LOCK_TIMEOUT_ENV} sets this limit)"
            )
        if not logged:
            logger.info(
                "waiting for another process's build of the fused CPU kernels (lock file %s; "
                "if no build is running, a killed one left it: delete it)",
                lock,
            )
            logged = True
        time.sleep(poll)


def libraries(directory: Path) -> dict[Path, float]:
    """The built libraries in ``directory`` and their modification times."""
    if not directory.is_dir():
        return {}
    return {path: path.stat().st_mtime for path in directory.glob("*.so")}


def load_message(
    before: dict[Path, float], after: dict[Path, float], seconds: float, directory: Path
) -> str:
    """The log line of a load that took ``seconds``: built, when a library in the build
    ``directory`` is new or changed since ``before`` (:func:`libraries` before and ``after``
    the load), else loaded from the cache."""
    if any(before.get(path) != mtime for path, mtime in after.items()):
        return f"fused CPU kernels built in {seconds:.1f} s ({directory})"
    return f"fused CPU kernels: loaded the cached build in {seconds:.1f} s ({directory})"


def _put_ninja_on_path() -> None:
    """torch's extension loader runs ``ninja`` from ``$PATH``; the ``ninja`` wheel (a dependency)
    installs it in the environment's ``bin``, which is not on ``$PATH`` when the environment
    is not activated (``.venv/bin/pyxllm serve``)."""
    try:
        import ninja  # here, in a try: without the ninja wheel, $PATH stays as it is
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(filter(None, [ninja.BIN_DIR, path]))


def build_and_load() -> None:
    """Build the library (or take the cached build) and load it into this process, registering
    ``torch.ops.pyxllm_cpu``.

    Raises:
        Exception: whatever the build raises (no compiler, a compile error), or TimeoutError
            for a stale lock.
    """
    from torch.utils.cpp_extension import load as load_extension  # lazy: see build_directory

    cflags, ldflags = compile_flags()
    _put_ninja_on_path()
    name = extension_name()
    directory = build_directory(name)
    sources = stage_sources(directory)
    before = libraries(directory)
    wait_for_build_lock(directory / "lock", float(os.environ.get(LOCK_TIMEOUT_ENV, 600)))
    if not before:
        logger.info(
            "building the fused CPU kernels for -march=%s in %s (the first load of these "
            "sources: 15-60 s)",
            target_arch(),
            directory,
        )
    start = time.perf_counter()
    load_extension(
        name=name,
        sources=sources,
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    seconds = time.perf_counter() - start
    logger.info("%s", load_message(before, libraries(directory), seconds, directory))
