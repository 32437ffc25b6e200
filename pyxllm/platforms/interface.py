"""What every device platform tells the rest of pyxllm.

A platform is data (which kernels, which attention backend, which runners, which collective
backend, which dtypes) plus a few queries answered through ``torch.<device>`` (``torch.cuda``,
``torch.npu`` once ``torch_npu`` is imported, ``torch.mlu`` once ``torch_mlu`` is). Peer
platforms share this interface, not code.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import logging
import math
import mmap
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from pyxllm.config import COMPUTE_DTYPES, CPU_KV_CACHE_GIB

logger = logging.getLogger(__name__)

GIB = 2**30
# the x86-64 and aarch64 (4 KiB granule) transparent huge page; the smallest tensor worth one
HUGE_PAGE_BYTES = 2 * 2**20
HUGE_PAGE_MIN_BYTES = 64 * 2**10
# ``0``: CPU weights stay where they were loaded and the KV cache's mapping is not advised for
# huge pages (see Platform.place_weights; the suite sets it, tests/conftest.py)
HUGE_PAGES_ENV = "PYXLLM_CPU_HUGE_PAGES"


def huge_pages_enabled() -> bool:
    """Whether CPU weights and KV caches go to memory advised for huge pages
    (``$PYXLLM_CPU_HUGE_PAGES``, default ``1``)."""
    return os.environ.get(HUGE_PAGES_ENV, "1") != "0"


# ``--dtype`` name -> torch dtype
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in COMPUTE_DTYPES}


def _glibc_malloc_trim():
    """glibc's ``malloc_trim`` through ctypes, or None (musl, macOS, Windows)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _glibc_malloc_trim()


class PlatformUnavailableError(ValueError):
    """A ``--device`` whose package or hardware is missing; the message names what to install."""


def package_installed(name: str) -> bool:
    """Whether ``name`` can be imported (found without importing it)."""
    return importlib.util.find_spec(name) is not None


def torch_release() -> str:
    """The installed torch's version without its local tag (``2.13.0+cpu`` -> ``2.13.0``)."""
    return torch.__version__.split("+")[0]


@dataclass(frozen=True, slots=True)
class FusedAttention:
    """An attention backend that needs an optional package.

    Attributes:
        package: the importable module it needs (``flash_attn``).
        backend: ``"module:Class"`` of the backend.
        block_multiple: ``--block-size`` must be a multiple of this for the backend to apply.
    """

    package: str
    backend: str
    block_multiple: int = 1


@dataclass(frozen=True, slots=True)
class DeviceGraphs:
    """``--graph-backend graph`` records decode steps as device graphs and replays them with no
    host work: ``torch.<device>.<graph_class>`` (``CUDAGraph``, ``NPUGraph``; one API)."""

    graph_class: str


@dataclass(frozen=True, slots=True)
class TorchScriptTraces:
    """``--graph-backend graph`` records decode steps with ``torch.jit.trace`` and replays them
    from TorchScript's interpreter, without Python (the CPU, where there are no device graphs).
    A trace cannot record collectives, so this capture runs on one TP rank only."""


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def physical_core_groups(cpus: list[int] | None = None) -> list[tuple[int, ...]]:
    """``cpus`` (default: this process's usable CPUs) grouped by physical core, hyper-threads of
    one core together (Linux's ``/sys`` topology; one CPU per group where it cannot be read),
    in the order of each group's first CPU."""
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    groups: dict[tuple[str, str] | int, list[int]] = {}
    for cpu in sorted(cpus):
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(topology + "physical_package_id") as p, open(topology + "core_id") as c:
                key: tuple[str, str] | int = (p.read().strip(), c.read().strip())
        except OSError:
            key = cpu
        groups.setdefault(key, []).append(cpu)
    return [tuple(group) for group in groups.values()]


def physical_cores() -> int:
    """The physical cores under this process's usable CPUs (hyper-threads of one core count
    once; Linux's ``/sys`` topology, else :func:`usable_cores`)."""
    return len(physical_core_groups()) or usable_cores()


@dataclass(frozen=True, slots=True)
class Platform:
    """A device platform: the one place that knows device-specific choices.

    Attributes:
        name: the ``--device`` spelling (``cpu``, ``cuda``, ``npu``, ``mlu``).
        torch_device: the ``torch.device`` type string.
        kernels_module: the kernel package bound to ``pyxllm.kernels.ops``.
        runners: the ``--graph-backend`` kinds this platform supports (``eager``, ``compile``,
            ``graph``).
        adaptive_threads: steps run on host threads whose count is chosen per step by
            measuring (``executor.thread_tuner``; the CPU).
        default_runner: what ``--graph-backend auto`` runs where the model allows it (the
            ``graph`` runner needs one rank and capturable layers, else ``eager``).
        dist_backend: the ``torch.distributed`` backend for tensor parallelism.
        default_dtype: what ``--dtype auto`` means here when the checkpoint declares no dtype.
        attention_backend: ``"module:Class"`` of the attention backend used when no entry of
            ``fused_attention`` applies (the pure-PyTorch one, which every platform runs).
        float16_dtype: what float16 computes in: a checkpoint declared float16 under ``--dtype
            auto``, and ``--dtype float16`` itself (bfloat16 on CPU, where float16 matmuls are
            slow and overflow-prone and the fused kernels take float32 and bfloat16 only).
        fused_attention: fused backends in order of preference, each used when its package is
            installed and the block size fits.
        graph_capture: what records a decode step for the ``graph`` runner
            (:class:`DeviceGraphs` or :class:`TorchScriptTraces`); ``None`` where ``runners``
            has no ``graph``.
        visible_devices_env: the variable that lists the cards every rank sees
            (``CUDA_VISIBLE_DEVICES``, ``ASCEND_RT_VISIBLE_DEVICES``); ``None`` on CPU.
        ray_resource: the Ray resource one rank reserves (``--distributed-executor-backend
            ray``; vLLM's ``ray_device_key``): one ``GPU``/``NPU``/``MLU`` per rank, or on the
            CPU its threads' worth of ``CPU``.
    """

    name: str
    torch_device: str
    kernels_module: str
    runners: tuple[str, ...]
    dist_backend: str
    default_dtype: torch.dtype
    attention_backend: str = "pyxllm.attention.torch_paged:TorchPagedAttentionBackend"
    float16_dtype: torch.dtype = torch.float16
    fused_attention: tuple[FusedAttention, ...] = ()
    graph_capture: DeviceGraphs | TorchScriptTraces | None = None
    visible_devices_env: str | None = None
    ray_resource: str = "CPU"
    default_runner: str = "eager"
    adaptive_threads: bool = False

    def __post_init__(self) -> None:
        if ("graph" in self.runners) != (self.graph_capture is not None):
            raise ValueError(
                f"platform {self.name}: the graph runner needs a graph_capture, and a "
                "graph_capture needs the graph runner"
            )

    @property
    def is_accelerator(self) -> bool:
        """Whether the device has its own memory to query (everything but CPU)."""
        return self.visible_devices_env is not None

    def device_module(self) -> ModuleType | None:
        """``torch.cuda`` / ``torch.npu`` / ``torch.mlu``; ``None`` on CPU."""
        return getattr(torch, self.torch_device) if self.is_accelerator else None

    def device(self, index: int = 0) -> torch.device:
        """The ``torch.device`` this process computes on."""
        return (
            torch.device(self.torch_device, index) if self.is_accelerator else torch.device("cpu")
        )

    def device_index(self, local_rank: int) -> int:
        """The card a rank computes on: every rank sees all cards of its node (through
        ``visible_devices_env``) and takes the one at its local rank, as xLLM does.

        Raises:
            ValueError: fewer visible cards than ``local_rank + 1`` (naming the variable).
        """
        if not self.is_accelerator:
            return 0
        count = self.device_module().device_count()
        if local_rank >= count:
            raise ValueError(
                f"--device {self.name}: rank {local_rank} needs card {local_rank} but only {count} "
                "are visible; every rank must see all cards of its node "
                f"({self.visible_devices_env})"
            )
        return local_rank

    def set_device(self, index: int) -> torch.device:
        """Make card ``index`` this process's current device and return it."""
        if self.is_accelerator:
            self.device_module().set_device(index)
        return self.device(index)

    def threads_per_rank(self, local_world_size: int) -> int:
        """Torch threads for each of ``local_world_size`` TP ranks on this host.

        On the CPU the ranks compute on the host's cores, so each gets
        ``usable_cores() // local_world_size`` (at least 1, and never more than this process
        has now, so ``OMP_NUM_THREADS`` still caps it); an accelerator's ranks keep the count
        they have.
        """
        current = torch.get_num_threads()
        if self.is_accelerator:
            return current
        return max(1, min(current, usable_cores() // max(1, local_world_size)))

    def tp_cores_warning(self, local_world_size: int) -> str | None:
        """On the CPU, why ``local_world_size`` TP ranks on this host will be slow: more ranks
        than physical cores (each then gets less than a core; see :meth:`threads_per_rank`);
        ``None`` when they fit, and on an accelerator."""
        if self.is_accelerator or local_world_size <= 1:
            return None
        cores = physical_cores()
        if local_world_size <= cores:
            return None
        return (
            f"--tensor-parallel-size {local_world_size} on the CPU: {local_world_size} ranks "
            f"share {cores} physical core{'s' if cores != 1 else ''} ({usable_cores()} usable "
            f"CPUs), {self.threads_per_rank(local_world_size)} thread each, so they take turns on "
            "the cores and every layer waits for two all-reduces between them: expect it to be "
            "several times slower than --tensor-parallel-size 1 (3 ranks on 2 cores took 7x as "
            "long), with a KV cache of --kv-cache-memory per rank; see docs/parallelism.md"
        )

    def check_runner(self, kind: str) -> None:
        """Refuse a ``--graph-backend`` this platform does not run (never replaced silently).

        Raises:
            ValueError: naming the flag, the kind, the device and the kinds it supports.
        """
        if kind != "auto" and kind not in self.runners:
            raise ValueError(
                f"--graph-backend {kind} is not supported on device {self.name}; "
                f"supported there: {', '.join(self.runners)}"
            )

    def kv_cache_bytes(
        self,
        kv_cache_memory: float | None,
        gpu_memory_utilization: float,
        device: torch.device,
    ) -> float:
        """Bytes the KV cache may take, measured after the weights are loaded.

        ``kv_cache_memory`` (GiB) wins when given. Otherwise an accelerator takes
        ``gpu_memory_utilization`` of the card's total memory less what is in use now
        (weights, other processes); the CPU takes ``pyxllm.config.CPU_KV_CACHE_GIB``.

        Raises:
            ValueError: the fraction leaves nothing for the cache (naming the flag and figures).
        """
        if kv_cache_memory is not None:
            return kv_cache_memory * GIB
        if not self.is_accelerator:
            return CPU_KV_CACHE_GIB * GIB
        free, total = self.device_module().mem_get_info(device)
        budget = total * gpu_memory_utilization - (total - free)
        if budget <= 0:
            raise ValueError(
                f"--gpu-memory-utilization: {gpu_memory_utilization} of {total / GIB:.1f} GiB "
                "leaves "
                f"nothing for the KV cache ({(total - free) / GIB:.1f} GiB already in use); raise "
                "it "
                "or set --kv-cache-memory"
            )
        return budget

    def select_attention_backend(self, block_size: int) -> str:
        """The first ``fused_attention`` entry whose package is installed and whose block
        multiple divides ``block_size``, else the pure-PyTorch ``attention_backend``."""
        for fused in self.fused_attention:
            if not package_installed(fused.package):
                continue
            if block_size % fused.block_multiple:
                logger.info(
                    "%s needs --block-size a multiple of %d; using %s",
                    fused.package,
                    fused.block_multiple,
                    self.attention_backend,
                )
                continue
            return fused.backend
        return self.attention_backend

    def zeros(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device):
        """One zeroed tensor per shape in ``shapes``, of ``dtype`` on ``device`` (the KV cache's
        per-layer K and V).

        On the CPU they lie in one anonymous memory mapping, which the kernel hands out zeroed
        page by page when a page is first written: the memory becomes resident as the cache's
        blocks are first used rather than all at start-up (``torch.zeros`` writes every page,
        so a 2 GiB budget was 2 GiB of resident memory before the first request), in huge pages
        where the kernel gives them (:func:`anonymous_mapping`: 8 sequences' decode attention
        over 1000 tokens, 30 layers, 2 Zen 4 cores: 19.1 -> 17.5 ms). Each tensor starts on a
        page boundary. The mapping is freed with the last tensor over it
        (``torch.frombuffer`` keeps it alive). An accelerator gets ``torch.zeros``.
        """
        if self.is_accelerator:
            return [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        elem = torch.empty((), dtype=dtype).element_size()
        sizes = [math.prod(shape) * elem for shape in shapes]
        offsets, total = _packed_offsets(sizes, mmap.PAGESIZE)
        if total == 0:
            return [torch.zeros(shape, dtype=dtype) for shape in shapes]
        buffer = anonymous_mapping(total)
        return [
            torch.frombuffer(buffer, dtype=dtype, count=size // elem, offset=offset).view(shape)
            for shape, size, offset in zip(shapes, sizes, offsets, strict=True)
        ]

    def place_weights(self, weights: list[torch.Tensor]) -> None:
        """On the CPU, move ``weights`` (a model's weight tensors; those of at least
        :data:`HUGE_PAGE_MIN_BYTES` that alone own their storage) into one anonymous memory
        mapping advised for transparent huge pages (``MADV_HUGEPAGE``), each tensor keeping its
        identity (``tensor.data`` is swapped, so a tied embedding holding the LM head's buffer
        follows it). A no-op on accelerators, and in effect where the kernel's huge pages are
        off (``/sys/kernel/mm/transparent_hugepage/enabled``: ``never``).

        Why: decode streams every weight once a step, and with 4 KiB pages a core's L2 TLB
        (Zen 4: 3072 entries, 12 MiB) misses once a page, and its hardware prefetchers stop at
        every page boundary; with 2 MiB pages neither happens. SmolLM2's 30 layers of int4
        weights at one row, 2 Zen 4 cores: 2.35 -> 2.15 and 2.72 -> 2.46 ms a step (alternating
        runs); the default model's batch-1 decode, two engines in one process taking turns
        (12 requests each, medians): 184.9 -> 204.0 and 191.1 -> 203.9 tok/s. glibc's
        ``malloc`` gives 4 KiB pages where huge pages are only advised (the kernel's default
        ``madvise`` mode, the machines' seen here).

        The cost: the mapping's pages are new memory, faulted in (zeroed) as the weights are
        copied. On the virtual machines seen here, memory the host has not backed yet zeroes at
        ~0.2 GB/s: up to ~3 s for 540 MB of float32 weights (the default model's 94 MB: well
        under a second), once per start-up. ``PYXLLM_CPU_HUGE_PAGES=0`` skips the move.
        """
        if self.is_accelerator or not hasattr(mmap, "MADV_HUGEPAGE") or not huge_pages_enabled():
            return
        owners: dict[int, list[torch.Tensor]] = {}
        for tensor in weights:
            owners.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
        tensors = [
            sharing[0]
            for sharing in owners.values()
            if len({id(t) for t in sharing}) == 1 and _movable(sharing[0])
        ]
        if not tensors:
            return
        # each tensor on a cache line
        offsets, total = _packed_offsets([tensor.nbytes for tensor in tensors], 64)
        buffer = anonymous_mapping(total + HUGE_PAGE_BYTES)
        arena = torch.frombuffer(buffer, dtype=torch.uint8)
        start = -arena.data_ptr() % HUGE_PAGE_BYTES  # the first tensor on a huge page boundary
        with torch.no_grad():
            for tensor, offset in zip(tensors, offsets, strict=True):
                placed = arena[start + offset : start + offset + tensor.nbytes]
                placed = placed.view(tensor.dtype).view(tensor.shape)
                placed.copy_(tensor)
                if tensor._base is not None:  # else the base would keep the old bytes alive
                    tensor._base.data = placed.view(tensor._base.shape)
                tensor.data = placed

    def synchronize(self) -> None:
        """Wait for the device's queued work (for timing); a no-op on CPU."""
        if self.is_accelerator:
            self.device_module().synchronize()

    def empty_cache(self) -> None:
        """Return cached, unused memory: an accelerator's to its driver; on the CPU, the freed
        heap pages glibc keeps (``malloc_trim(0)``), which the start-up's warm-up steps and
        graph captures leave behind (~280 MiB of resident memory for SmolLM2 with the graph
        runner, AVX2 EPYC). A no-op where the C library is not glibc."""
        if self.is_accelerator:
            self.device_module().empty_cache()
        elif _malloc_trim is not None:
            _malloc_trim(0)


def _packed_offsets(sizes: list[int], align: int) -> tuple[list[int], int]:
    """The byte offsets of blocks of ``sizes`` bytes laid one after another in one buffer, each
    starting on a multiple of ``align``, and the buffer's size."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // align) * align
    return offsets, total


def anonymous_mapping(size: int) -> mmap.mmap:
    """``size`` bytes of private anonymous memory, zero until written and resident page by page
    as it is first written, advised for transparent huge pages (``MADV_HUGEPAGE``) where the
    system has them: with the kernel's default ``madvise`` mode, only advised memory gets them
    (a shared mapping, ``mmap.mmap(-1, size)``'s default, never does)."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows
        return mmap.mmap(-1, size)
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE") and huge_pages_enabled():
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


def _movable(tensor: torch.Tensor) -> bool:
    """Whether :meth:`Platform.place_weights` can move ``tensor``: a contiguous CPU tensor of at
    least :data:`HUGE_PAGE_MIN_BYTES` that is its storage's only view, or a view of the whole of
    a contiguous tensor that is not a view itself (a packed weight reshaped)."""
    base = tensor._base
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.untyped_storage().nbytes() == tensor.nbytes >= HUGE_PAGE_MIN_BYTES
        and (
            base is None
            or (base._base is None and base.is_contiguous() and base.nbytes == tensor.nbytes)
        )
    )


def load_class(path: str):
    """The object at ``"package.module:Name"``."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
