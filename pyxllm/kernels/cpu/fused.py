"""Fused CPU kernels (``csrc/cpu_kernels.cpp``), built by :func:`load` (when the CPU platform
binds ``pyxllm.kernels.cpu``) with PyTorch's C++ extension loader, behind the signatures of
``pyxllm.kernels.native``.

Why: on a CPU, a batch-1 decode step is mostly per-op overhead, not arithmetic. Each native
RMSNorm, rotary embedding or decode attention is a chain of 5-15 small ATen ops (a few
microseconds each, several tens for small bfloat16 matmuls), repeated in every layer; one fused
call per op took SmolLM2-135M's int4 batch-1 decode step from 18 to 10 ms on 2 cores (README,
Performance). vLLM's CPU backend fuses the same ops (its ``csrc/cpu``); ours are plain loops
and GCC/Clang vector extensions that the compiler vectorizes, in float32 and bfloat16.

One is a matmul: ``linear`` over 1 to 8 float32 rows (a small decode batch, a sequence
verifying speculative drafts), which reads each weight row once for all rows. On the
development machine's AVX2 CPU, over weights streaming from memory as a model's do (30 layers
of SmolLM2's projections, 424 MB of float32), MKL took 53 ms for one row and 101 ms for five;
this kernel 26 and 34 ms (and the LM head's 113 MB in 7 ms instead of 14).

The build (g++ and ninja, 15-60 s on 2 cores) is cached in torch's extension directory
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), keyed by the source, the
flags and the include paths, so it happens once per machine and environment; the log says
whether a load built the kernels or took the cached build, and how long it took. Concurrent
first loads wait on torch's lock file (``lock`` in the build directory); a build that was killed
leaves it behind, and torch would wait on it for ever, so a load that finds it logs its path and
gives up once the lock is ``PYXLLM_CPU_KERNELS_LOCK_TIMEOUT`` seconds old (default 600; a build
takes about a minute). Where it fails (no compiler, a stale lock), :func:`load` returns ``None``
after one warning, and with ``PYXLLM_CPU_KERNELS=native`` without trying; the CPU platform then
keeps the native kernels.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

from pyxllm.kernels import native
from pyxllm.kernels.cpu.features import cpu_feature_line

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
_ENV = "PYXLLM_CPU_KERNELS"
_LOCK_TIMEOUT_ENV = "PYXLLM_CPU_KERNELS_LOCK_TIMEOUT"
# the kernels below, bound in place of the native ones of the same names
KERNELS = (
    "apply_rotary_emb",
    "fused_add_rms_norm",
    "linear",
    "paged_attention_decode",
    "reshape_and_cache",
    "rms_norm",
    "silu_and_mul",
    "w8a8_linear",
)


def _compile_flags() -> tuple[list[str], list[str], str]:
    """``(extra_cflags, extra_ldflags, suffix)``.

    ``-ffp-contract=off`` keeps float32 results equal to the reference's where the arithmetic is
    the same (no fused multiply-add). On x86-64/aarch64 Linux: ``-march=native``, with a suffix
    from the CPU's feature flags so a home directory shared by different CPUs keeps one build
    each; and ``-fopenmp``, without which ``at::parallel_for`` runs on one thread (the library
    resolves to the ``libgomp.so.1`` torch already loaded, so there is one OpenMP runtime).
    """
    flags = ["-O3", "-ffp-contract=off", "-fno-trapping-math"]
    if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64"):
        suffix = hashlib.sha1(cpu_feature_line().encode()).hexdigest()[:8]
        return [*flags, "-march=native", "-fopenmp"], ["-fopenmp"], suffix
    return flags, [], "generic"


def _put_ninja_on_path() -> None:
    """torch's extension loader runs ``ninja`` from ``$PATH``; the ``ninja`` wheel (a dependency)
    installs it in the environment's ``bin``, which is not on ``$PATH`` when the environment
    is not activated (``.venv/bin/pyxllm serve``)."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(filter(None, [ninja.BIN_DIR, path]))


def _register_fakes() -> None:
    """Shape-only implementations, so the ops can appear in ``torch.compile`` graphs."""
    lib = "pyxllm_cpu::"

    @torch.library.register_fake(lib + "rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "fused_add_rms_norm")
    def _(x, residual, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake(lib + "silu_and_mul")
    def _(x):
        return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)

    @torch.library.register_fake(lib + "apply_rotary_emb")
    def _(q, k, cos, sin):
        return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
            k, memory_format=torch.contiguous_format
        )

    @torch.library.register_fake(lib + "paged_attention_decode")
    def _(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=0):
        return query.new_empty(query.shape)

    @torch.library.register_fake(lib + "w8a8_linear")
    def _(x, qweight, weight_scales, bias, hadamard_block=0):
        return x.new_empty(*x.shape[:-1], qweight.shape[0])

    @torch.library.register_fake(lib + "small_batch_linear")
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])


def extension_name() -> str:
    """The extension's name, ``pyxllm_cpu_kernels_<suffix>`` (the suffix keys the CPU's feature
    flags, see :func:`_compile_flags`): its directory in torch's extension cache."""
    return f"pyxllm_cpu_kernels_{_compile_flags()[2]}"


def build_status() -> dict[str, str | None]:
    """What :func:`load` would find, without building or loading anything (``pyxllm env``).

    Returns:
        ``mode``: ``fused`` or ``native`` (``$PYXLLM_CPU_KERNELS``); ``name``: the extension's
        name; ``cache_dir``: its build directory in torch's extension cache (created if
        missing, as torch does); ``library``: the built ``.so`` there, ``None`` before the
        first build; ``compiler``: the C++ compiler torch would run (``$CXX``, else ``c++``)
        as found on ``$PATH``, ``None`` when it is not there; ``status``: ``built``,
        ``stale`` (older than the source: the next load rebuilds it), ``not built`` or
        ``disabled``.
    """
    import shutil

    from torch.utils.cpp_extension import _get_build_directory, get_cxx_compiler

    name = extension_name()
    cache_dir = _get_build_directory(name, verbose=False)
    library = os.path.join(cache_dir, f"{name}.so")
    built = os.path.isfile(library)
    if os.environ.get(_ENV, "fused") == "native":
        status = "disabled"
    elif not built:
        status = "not built"
    elif os.path.getmtime(library) < os.path.getmtime(_SOURCE):
        status = "stale"
    else:
        status = "built"
    return {
        "mode": "native" if status == "disabled" else "fused",
        "status": status,
        "name": name,
        "cache_dir": cache_dir,
        "library": library if built else None,
        "compiler": shutil.which(get_cxx_compiler()),
    }


def _build_directory(name: str) -> Path | None:
    """torch's build directory of extension ``name`` (``None`` if this torch hides it)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, verbose=False))
    except (ImportError, TypeError, OSError):
        return None


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
                f"behind (delete it if no build is running; {_LOCK_TIMEOUT_ENV} sets this limit)"
            )
        if not logged:
            logger.info(
                "waiting for another process's build of the fused CPU kernels (lock file %s; "
                "if no build is running, a killed one left it: delete it)",
                lock,
            )
            logged = True
        time.sleep(poll)


def _libraries(directory: Path | None) -> dict[Path, float]:
    """The built libraries in ``directory`` and their modification times."""
    if directory is None or not directory.is_dir():
        return {}
    return {path: path.stat().st_mtime for path in directory.glob("*.so")}


def load_message(
    before: dict[Path, float], after: dict[Path, float], seconds: float, directory: Path | None
) -> str:
    """The log line of a load that took ``seconds``: built, when a library in the build
    ``directory`` is new or changed since ``before`` (:func:`_libraries` before and
    ``after`` the load), else loaded from the cache."""
    if any(before.get(path) != mtime for path, mtime in after.items()):
        return f"fused CPU kernels built in {seconds:.1f} s ({directory})"
    return f"fused CPU kernels: loaded the cached build in {seconds:.1f} s ({directory})"


@functools.cache
def load():
    """``torch.ops.pyxllm_cpu`` with the fused kernels built and loaded, or ``None`` (see the
    module docstring); tried at most once per process."""
    if os.environ.get(_ENV, "fused") == "native":
        logger.info("%s=native: using the pure-PyTorch CPU kernels", _ENV)
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        cflags, ldflags, _ = _compile_flags()
        _put_ninja_on_path()
        name = extension_name()
        directory = _build_directory(name)
        before = _libraries(directory)
        if directory is not None:
            wait_for_build_lock(directory / "lock", float(os.environ.get(_LOCK_TIMEOUT_ENV, 600)))
        if not before:
            logger.info(
                "building the fused CPU kernels in %s (the first load in an environment: 15-60 s)",
                directory or "torch's extension directory",
            )
        start = time.perf_counter()
        load_extension(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            is_python_module=False,
            verbose=False,
        )
        seconds = time.perf_counter() - start
        logger.info("%s", load_message(before, _libraries(directory), seconds, directory))
        _register_fakes()
        return torch.ops.pyxllm_cpu
    except Exception as exc:  # noqa: BLE001 - any build failure means: fall back to native
        logger.warning(
            "fused CPU kernels unavailable (%s: %s); using the pure-PyTorch ones (slower)",
            type(exc).__name__,
            str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
        )
        return None


# The kernels under ``pyxllm.kernels.native``'s names and signatures (:data:`KERNELS`, bound by
# ``pyxllm.kernels.cpu.on_bind`` once :func:`load` succeeded).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See ``pyxllm.kernels.native.rms_norm`` (``x [..., hidden]``, float32 or bfloat16)."""
    return torch.ops.pyxllm_cpu.rms_norm.default(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``pyxllm.kernels.native.fused_add_rms_norm``; both results are new tensors."""
    return torch.ops.pyxllm_cpu.fused_add_rms_norm.default(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See ``pyxllm.kernels.native.silu_and_mul`` (``[..., 2d] -> [..., d]``)."""
    return torch.ops.pyxllm_cpu.silu_and_mul.default(x)


def apply_rotary_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``pyxllm.kernels.native.apply_rotary_emb``; ``q``/``k`` may be strided views (the
    split of a fused QKV output), the results are contiguous."""
    return torch.ops.pyxllm_cpu.apply_rotary_emb.default(q, k, cos, sin)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """See ``pyxllm.kernels.native.reshape_and_cache``; K/V must already be in the cache's dtype.

    Raises:
        RuntimeError: a slot outside the cache, or a dtype mismatch.
    """
    torch.ops.pyxllm_cpu.reshape_and_cache.default(key, value, k_cache, v_cache, slot_mapping)


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    attn_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """See ``pyxllm.kernels.native.paged_attention_decode``. Each row attends to exactly its
    ``seq_lens[b]`` tokens (its last ``sliding_window`` of them), so ``max_seq_len`` and
    ``attn_mask`` are not needed (a row of length 0, graph padding, gets zeros). Soft-capped
    layers (Gemma 2) take the native kernel."""
    if logits_soft_cap is not None:
        return native.paged_attention_decode(
            query, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, attn_mask,
            sliding_window, logits_soft_cap,
        )  # fmt: skip
    return torch.ops.pyxllm_cpu.paged_attention_decode.default(
        query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window or 0
    )


# rows up to which ``linear`` takes the C++ kernel (its kSmallLinearRows)
SMALL_LINEAR_ROWS = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """See ``pyxllm.kernels.native.linear``: float32 over at most :data:`SMALL_LINEAR_ROWS`
    rows with a contiguous weight takes the C++ kernel (one pass over the weights, float32
    sums in another order than BLAS: results agree to ~1e-6 relative), anything else
    ``F.linear``."""
    if (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and (bias is None or bias.dtype == torch.float32)
        and 0 < x.numel() <= SMALL_LINEAR_ROWS * x.shape[-1]
    ):
        return torch.ops.pyxllm_cpu.small_batch_linear.default(x, weight, bias)
    return native.linear(x, weight, bias)


def w8a8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    hadamard_block: int = 0,
) -> torch.Tensor:
    """See ``pyxllm.kernels.native.w8a8_linear``: the same int8 activations and int32 sums
    (``torch._int_mm``, oneDNN's VNNI kernels), with the Hadamard transform, quantization and
    rescaling fused around it.

    Raises:
        RuntimeError: ``qweight`` not int8 ``[N, K]``, ``weight_scales`` not float32 ``[N]``, a
            ``hadamard_block`` that is not a power of two dividing ``K``.
    """
    return torch.ops.pyxllm_cpu.w8a8_linear.default(x, qweight, weight_scales, bias, hadamard_block)
