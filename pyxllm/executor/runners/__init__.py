"""Runners execute the model forward: ``eager``, ``compile`` (``torch.compile``) and ``graph``
(decode steps captured per batch-size bucket, prefill eager: device graphs on an accelerator,
TorchScript traces on the CPU). Every runner gives the same greedy
tokens as eager; the platform says which ones it supports, and any other is refused by name."""

from __future__ import annotations

import logging
import os

from pyxllm import kernels
from pyxllm.distributed.parallel_state import get_tp_size
from pyxllm.executor.runners.base import Runner
from pyxllm.executor.runners.compiled import CompileRunner
from pyxllm.executor.runners.eager import EagerRunner
from pyxllm.executor.runners.graph import (
    DeviceGraphCapture,
    EagerCapture,
    GraphRunner,
    TraceCapture,
    capture_sizes,
)
from pyxllm.platforms.interface import TorchScriptTraces

__all__ = [
    "CompileRunner",
    "DeviceGraphCapture",
    "EagerCapture",
    "EagerRunner",
    "GraphRunner",
    "Runner",
    "TraceCapture",
    "build_runner",
    "capture_sizes",
    "graph_capture_for",
    "lora_runner",
    "resolve_runner",
]

logger = logging.getLogger(__name__)

# names what ``--graph-backend auto`` runs instead of the platform's choice (the suite pins eager)
DEFAULT_ENV = "PYXLLM_DEFAULT_GRAPH_BACKEND"


def resolve_runner(kind: str, model, platform) -> str:
    """The runner ``--graph-backend kind`` stands for: ``auto`` is ``$PYXLLM_DEFAULT_GRAPH_BACKEND``
    if set, else the platform's ``default_runner`` where ``model`` allows it: the graph runner
    needs one TP rank on the CPU (a trace cannot record collectives) and layers that are all
    capturable (no Python on the data, as MoE routing); pyxllm's own models only (the
    transformers backend's are not traced here). Anything else runs ``eager``.

    Raises:
        ValueError: an override the platform does not run.
    """
    if kind != "auto":
        return kind
    override = os.environ.get(DEFAULT_ENV, "").strip().lower()
    if override:
        platform.check_runner(override)
        return override
    choice = platform.default_runner
    if choice == "graph" and (
        (isinstance(platform.graph_capture, TorchScriptTraces) and get_tp_size() > 1)
        or not all(getattr(m, "capturable", True) for m in model.modules())
        or getattr(model, "model_impl", "pyxllm") != "pyxllm"
    ):
        choice = "eager"
    logger.info(
        "--graph-backend auto: runner %s%s",
        choice,
        " (decode steps captured at start-up; --graph-backend eager skips that)"
        if choice == "graph"
        else "",
    )
    return choice


def lora_runner(kind: str, requested: str, platform) -> str:
    """The runner that serves LoRA adapters in place of ``kind`` (what ``--graph-backend
    requested`` resolved to): ``graph`` where its captures take the adapters as inputs
    (TorchScript traces, with the fused CPU ``lora_delta``, which reads its segments in C++),
    else ``eager``, as is ``compile`` (its guards would specialize on a step's adapters).

    Raises:
        ValueError: ``--graph-backend graph`` asked for by name where it cannot take adapters.
    """
    if kind == "eager":
        return kind
    why = None
    if kind == "compile":
        why = "torch.compile would specialize on a step's adapters"
    elif not isinstance(platform.graph_capture, TorchScriptTraces):
        why = "device graphs replay the adapter buffers they recorded"
    elif kernels.ops.lora_delta is kernels.native.lora_delta:
        why = (
            "the pure-PyTorch lora_delta reads its segments in Python, which a trace would "
            "record as constants (the fused CPU kernels are not loaded)"
        )
    if why is None:
        return kind
    if requested == kind:
        raise ValueError(
            f"--graph-backend {kind}: not with --enable-lora here: {why}; use --graph-backend eager"
        )
    logger.info("--enable-lora: runner eager, not %s (%s)", kind, why)
    return "eager"


def graph_capture_for(platform) -> DeviceGraphCapture | TraceCapture:
    """What records the graph runner's decode steps on ``platform`` (its ``graph_capture``).

    Raises:
        ValueError: TorchScript traces under tensor parallelism (they cannot record collectives).
    """
    kind = platform.graph_capture
    if isinstance(kind, TorchScriptTraces):
        if get_tp_size() > 1:
            raise ValueError(
                f"--graph-backend graph on device {platform.name} records decode steps with "
                "torch.jit.trace, which cannot record collectives: use it with --tp 1"
            )
        return TraceCapture()
    return DeviceGraphCapture(platform.device_module(), kind.graph_class)


def build_runner(
    kind: str,
    model,
    platform,
    attn_backend=None,
    kv_caches=None,
    max_batch: int = 1,
    max_model_len: int = 1,
    block_size: int = 16,
    max_query_len: int = 1,
    lora=None,
) -> Runner:
    """The runner of ``kind`` (``eager``, ``compile`` or ``graph``; aliases are normalized by
    ``EngineConfig``) for ``model`` on ``platform``; ``graph`` captures its buckets here and
    replays queries of up to ``max_query_len`` tokens (see :class:`GraphRunner`), with the
    LoRA adapters of ``lora`` (a ``LoRAManager``) as inputs of its captures.

    Raises:
        ValueError: ``kind`` is not among ``platform.runners`` (never replaced by another).
    """
    platform.check_runner(kind)
    if kind == "eager":
        return EagerRunner(model)
    if kind == "compile":
        return CompileRunner(model)
    return GraphRunner(
        model,
        attn_backend,
        kv_caches,
        max_batch,
        max_model_len,
        block_size,
        graph_capture_for(platform),
        max_query_len,
        lora,
    )
