"""The model executor of one TP rank: owns the model, its KV cache, the attention backend,
the runner and the sampler, and executes one scheduler step at a time."""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import torch
from tqdm import tqdm

from pyxllm.config import EngineConfig
from pyxllm.executor.input_batch import InputBatch
from pyxllm.executor.kv_cache import KVCacheSpec, allocate_kv_caches
from pyxllm.executor.runners.eager import EagerRunner
from pyxllm.executor.sampler import Sampler, SamplingMetadata
from pyxllm.executor.scheduler_output import SchedulerOutput
from pyxllm.layers.forward_context import ForwardContext, set_forward_context
from pyxllm.models.registry import resolve_model_class
from pyxllm.models.weight_loading import load_weights
from pyxllm.platforms import Platform
from pyxllm.weights import ModelSource, iter_weights

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(model_config) -> torch.dtype | None:
    """The dtype config.json declares (``dtype``, or ``torch_dtype`` before transformers 5), if any.

    ``None`` when absent (e.g. a GGUF file) or not a float dtype pyxllm computes in.
    """
    # reading ``torch_dtype`` on a transformers 5 config warns; read it only where ``dtype`` is absent
    name = "dtype" if hasattr(model_config, "dtype") else "torch_dtype"
    value = getattr(model_config, name, None)
    if isinstance(value, str):
        return _DTYPES.get(value.removeprefix("torch."))
    return value if value in _DTYPES.values() else None


def resolve_dtype(dtype: str, platform: Platform, model_config=None) -> torch.dtype:
    """The compute dtype for ``--dtype``.

    ``auto`` takes the checkpoint's dtype from ``model_config`` (see :func:`checkpoint_dtype`),
    except float16 on CPU, which becomes bfloat16 (as vLLM does); without one (GGUF) it is the
    platform's default, float32 on CPU. Any other value is taken as given.
    """
    if dtype != "auto":
        return _DTYPES[dtype]
    declared = checkpoint_dtype(model_config)
    if declared is None:
        return platform.default_dtype
    return torch.bfloat16 if declared == torch.float16 and platform.name == "cpu" else declared


@dataclass(slots=True)
class StepResult:
    """Sampled token ids, one per scheduled sequence (``None`` where the step did not sample)."""

    sampled_token_ids: list[int | None]


class ModelExecutor:
    """Loads the model for ``model_config`` and runs steps on ``platform``'s device.

    Raises:
        ValueError: an unsupported architecture, a bad checkpoint, or a KV cache budget too small
            to hold one block.
    """

    def __init__(self, config: EngineConfig, model_config, source: ModelSource, platform: Platform) -> None:
        self.config, self.model_config, self.platform = config, model_config, platform
        self.device = platform.device()
        self.dtype = resolve_dtype(config.dtype, platform, model_config)
        model_cls = resolve_model_class(model_config, platform.name)
        torch.manual_seed(config.seed)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_cls(model_config).eval()
        finally:
            torch.set_default_dtype(previous)
        weights = tqdm(iter_weights(source, model_config), desc="Loading weights", unit=" tensors", leave=False)
        load_weights(self.model, weights)

        self.kv_spec = KVCacheSpec.from_model(self.model, config.block_size, self.dtype)
        self.num_kv_blocks = self.kv_spec.num_blocks_for(config.kv_cache_memory * 2**30)
        self.kv_caches = allocate_kv_caches(self.kv_spec, self.num_kv_blocks, self.device)
        module, cls = platform.attention_backend.split(":")
        self.attn_backend = getattr(importlib.import_module(module), cls)()
        self.runner = EagerRunner(self.model)
        self.sampler = Sampler(config.seed, self.device)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Run one forward pass over ``plan`` and sample where the plan says so."""
        batch = InputBatch.build(plan, self.config.block_size, self.device)
        ctx = ForwardContext(attn=self.attn_backend.build(batch), kv_caches=self.kv_caches)
        with set_forward_context(ctx):
            hidden_states = self.runner(batch.input_ids, batch.positions)
        sampled: list[int | None] = [None] * len(plan.sequences)
        rows = [i for i, s in enumerate(plan.sequences) if s.sample]
        if rows:
            logits = self.model.compute_logits(hidden_states.index_select(0, batch.logits_indices))
            meta = SamplingMetadata.build([plan.sequences[i] for i in rows], logits.shape[-1], self.device)
            for row, token in zip(rows, self.sampler(logits, meta).tolist()):
                sampled[row] = token
        return StepResult(sampled)
