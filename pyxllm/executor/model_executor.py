"""The model executor of one TP rank: owns the model, its KV cache, the attention backend,
the runner and the sampler, and executes one scheduler step at a time."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from tqdm import tqdm

from pyxllm.attention.abstract import AttentionBackend
from pyxllm.config import EngineConfig
from pyxllm.distributed.parallel_state import (
    get_local_rank,
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_min,
)
from pyxllm.executor.draft_model import DraftModel
from pyxllm.executor.encoder_cache import EncoderCache
from pyxllm.executor.input_batch import InputBatch
from pyxllm.executor.kv_cache import KVCacheSpec, allocate_kv_caches
from pyxllm.executor.logits_processors import compute_logprobs
from pyxllm.executor.pooling import pool_sequences
from pyxllm.executor.runners import build_runner, lora_runner, resolve_runner
from pyxllm.executor.sampler import Sampler, SamplingMetadata
from pyxllm.executor.scheduler_output import SchedulerOutput
from pyxllm.executor.spec_decode import GeneratorRewind, accept_drafts, expand_for_verification
from pyxllm.executor.thread_tuner import make_thread_tuner, one_thread
from pyxllm.layers.forward_context import ForwardContext, MultiModalEmbeddings
from pyxllm.layers.pooler import Pooler
from pyxllm.layers.quantization import (
    prepare_model,
    quantize_model,
    resolve_quantization,
    weight_bytes,
    weight_tensors,
)
from pyxllm.lora.manager import LoRAManager, LoRAStep
from pyxllm.lora_request import LoRARequest
from pyxllm.models.build_context import build_model
from pyxllm.models.registry import resolve_model_class
from pyxllm.models.weight_loading import load_weights
from pyxllm.platforms import Platform
from pyxllm.platforms.interface import TORCH_DTYPES, load_class
from pyxllm.sampling_params import FULL_VOCAB_LOGPROBS
from pyxllm.weights import ModelSource, iter_weight_slices
from pyxllm.weights.pooling_config import load_pooling_config

logger = logging.getLogger(__name__)


def checkpoint_dtype(model_config) -> torch.dtype | None:
    """The dtype config.json declares (``dtype``, or ``torch_dtype`` before transformers 5), if any.

    ``None`` when absent (e.g. a GGUF file) or not a float dtype pyxllm computes in.
    """
    # reading ``torch_dtype`` on a transformers 5 config warns; read it only where ``dtype`` is
    # absent
    name = "dtype" if hasattr(model_config, "dtype") else "torch_dtype"
    value = getattr(model_config, name, None)
    if isinstance(value, str):
        return TORCH_DTYPES.get(value.removeprefix("torch."))
    return value if value in TORCH_DTYPES.values() else None


def resolve_dtype(dtype: str, platform: Platform, model_config=None) -> torch.dtype:
    """The compute dtype for ``--dtype``.

    ``auto`` takes the checkpoint's dtype from ``model_config`` (see :func:`checkpoint_dtype`),
    except float16, which becomes the platform's ``float16_dtype`` (bfloat16 on CPU, as vLLM
    does); without one (GGUF) it is the platform's default, float32 on CPU. An explicit
    ``float16`` on a platform that does not compute in it becomes ``float16_dtype`` too, with a
    warning (vLLM's CPU backend does the same; our fused CPU kernels take float32 and bfloat16).
    Any other value is taken as given.
    """
    if dtype == "float16" and platform.float16_dtype != torch.float16:
        logger.warning(
            "--dtype float16 is not supported on %s: using %s",
            platform.name,
            str(platform.float16_dtype).removeprefix("torch."),
        )
        return platform.float16_dtype
    if dtype != "auto":
        return TORCH_DTYPES[dtype]
    declared = checkpoint_dtype(model_config)
    if declared is None:
        return platform.default_dtype
    return platform.float16_dtype if declared == torch.float16 else declared


# ``(token ids, logprobs, rank of the first)``: a given token (sampled, or the next prompt
# token) first, then the most likely ones (see ``logits_processors.LogprobsTensors``).
TokenLogprobs = tuple[list[int], list[float], int]


@dataclass(slots=True)
class StepResult:
    """The tokens each scheduled sequence emitted: one sampled token, or with speculative
    drafts the accepted drafts then the target's next token (empty where the step did not
    sample).

    ``logprobs[i]``: per emitted token, its :data:`TokenLogprobs` with the ``logprobs`` top
    ones, for sequences that asked; ``prompt_logprobs[i]``: one per ``prompt_logprob_targets``
    entry, or for ``prompt_logprobs=-1`` the whole vocabulary's log-softmax at those positions,
    ``float32 [len(targets), vocab_size]`` on the CPU. Each list is ``None`` when no sequence
    asked, and holds ``None`` for those that did not.

    ``pooled[i]`` (the embed task, :mod:`pyxllm.executor.pooling_executor`): sequence ``i``'s
    embedding, ``float32 [dimensions or hidden_size]`` on the CPU, once its whole prompt is
    computed (``None`` before); ``pooled`` is ``None`` for a generation step.
    """

    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None = None
    prompt_logprobs: list[list[TokenLogprobs] | torch.Tensor | None] | None = None
    pooled: list[torch.Tensor | None] | None = None


def _resident_memory() -> str:
    """This process's resident host memory (``VmRSS``), e.g. ``"752 MiB"``; ``"unknown"`` where
    ``/proc`` does not say."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return f"{int(line.split()[1]) / 1024:.0f} MiB"
    except OSError:
        pass
    return "unknown"


def tuner_key(batch: InputBatch, lora_step: LoRAStep | None):
    """What the thread tuner times a step under (:class:`ThreadTuner`'s ``key``): ``None`` for a
    step with prefill rows (not timed), else its number of rows, paired with ``"lora"`` when
    some row runs an adapter, so that a LoRA engine's base-only and adapter steps, whose costs
    differ, are compared only with their own kind."""
    if not batch.decodes_only:
        return None
    rows = len(batch.input_ids)
    return rows if lora_step is None else (rows, "lora")


class ModelExecutor:
    """Loads the model for ``model_config`` and runs steps on ``platform``'s device.

    There is one per TP rank, each holding its shard; only rank 0 samples. The engine reaches
    rank 0's through an :class:`~pyxllm.executor.abstract.Executor` (``UniprocExecutor`` in one
    process, ``MultiprocExecutor`` driving the workers), a worker's runs in
    :func:`~pyxllm.executor.worker.run_worker`.

    The device is the card at this rank's index (``platform.device_index``); the attention
    backend is the platform's choice for ``--block-size``; the runner is ``--graph-backend``'s.

    With ``--task embed`` (a decoder embedding model such as Qwen3-Embedding) the steps pool
    instead of sampling: each sequence is a whole prompt, its hidden states go to
    :attr:`pooler` (last-token pooling unless the checkpoint's sentence-transformers modules say
    otherwise) and the step's :class:`StepResult` carries ``pooled``. The LM head is not
    loaded (it is tied to the embedding, and the checkpoint's is skipped), and a checkpoint
    saved from the base model (``layers.0...`` without ``model.``) loads too.

    Raises:
        ValueError: an unsupported architecture or runner, a bad checkpoint, or a KV cache
            budget too small to hold one block.
    """

    def __init__(
        self, config: EngineConfig, model_config, source: ModelSource, platform: Platform
    ) -> None:
        self.config, self.model_config, self.platform = config, model_config, platform
        platform.check_runner(config.graph_backend)
        self.device = platform.set_device(platform.device_index(get_local_rank()))
        self.dtype = resolve_dtype(config.dtype, platform, model_config)
        model_cls = resolve_model_class(model_config, platform.name, config.model_impl)
        torch.manual_seed(config.seed)
        self.pooler: Pooler | None = None
        built_config = model_config
        if config.task == "embed":
            pooling = load_pooling_config(source.path if source.kind == "hf" else None, "LAST")
            self.pooler = Pooler(pooling.pooling_type, pooling.normalize)
            built_config = copy.copy(model_config)  # the LM head is never computed
            built_config.tie_word_embeddings = True
        # --max-model-len reaches the models that depend on it (Phi-3's LongRoPE factors)
        self.model = build_model(
            model_cls, built_config, self.device, self.dtype, config.max_model_len
        )
        if self.pooler is not None:
            self.model.rename_checkpoint_tensor = _embedding_checkpoint_name
        # unread weights: each parameter's loader reads only this TP rank's slice
        weights = iter_weight_slices(source, model_config)
        if get_tp_rank() == 0:  # one progress bar, not one per rank
            weights = tqdm(
                weights, desc="Loading weights", unit=" tensors", leave=False, disable=None
            )
        self.quantization = resolve_quantization(config.quantization, source.kind)
        prepare_model(self.model, self.quantization)
        with one_thread():  # numpy decoding and packing: see one_thread
            load_weights(self.model, weights)
            quantize_model(self.model, self.quantization, batch_invariant=config.batch_invariant)
            platform.place_weights(weight_tensors(self.model))  # before a runner records them

        cache_dtype = torch.int8 if config.kv_cache_dtype == "int8" else self.dtype
        self.kv_spec = KVCacheSpec.from_model(self.model, config.block_size, cache_dtype)
        budget = platform.kv_cache_bytes(
            config.kv_cache_memory, config.gpu_memory_utilization, self.device
        )
        # every TP rank must hold the same blocks: take the smallest count any rank can afford
        self.num_kv_blocks = tensor_model_parallel_min(self.kv_spec.num_blocks_for(budget))
        self.kv_caches = allocate_kv_caches(self.kv_spec, self.num_kv_blocks, platform, self.device)
        backend_cls = load_class(platform.select_attention_backend(config.block_size))
        if cache_dtype == torch.int8 and not getattr(backend_cls, "supports_int8_kv_cache", False):
            raise ValueError(
                f"--kv-cache-dtype int8: the {platform.name} platform's attention backend "
                f"({backend_cls.__name__}) has no int8 KV cache; use --kv-cache-dtype auto"
            )
        self.attn_backend: AttentionBackend = backend_cls()
        if config.batch_invariant:
            self._make_batch_invariant(backend_cls)
        max_model_len = (
            config.max_model_len
            or getattr(_text_config(model_config), "max_position_embeddings", None)
            or 2048
        )
        self.lora = (
            LoRAManager(
                self.model,
                config.max_lora_rank,
                config.lora_slots,
                self.device,
                self.dtype,
                config.max_loras,
            )
            if config.enable_lora
            else None
        )
        self._lora_step: LoRAStep | None = None
        # a vision-language model's encoder outputs by image hash (see encoder_cache.py)
        self.encoder_cache = (
            EncoderCache(self.model, self.device)
            if hasattr(self.model, "embed_multimodal")
            else None
        )
        self._mm_step: MultiModalEmbeddings | None = None
        runner_kind = resolve_runner(config.graph_backend, self.model, platform)
        if self.lora is not None:
            runner_kind = lora_runner(runner_kind, config.graph_backend, platform)
        self.runner = build_runner(
            runner_kind,
            self.model,
            platform,
            self.attn_backend,
            self.kv_caches,
            max_batch=config.max_seqs_per_batch,
            max_model_len=max_model_len,
            block_size=config.block_size,
            max_query_len=1
            + (config.speculative.num_speculative_tokens if config.speculative else 0),
            lora=self.lora,
        )
        self.sampler = Sampler(config.seed, self.device)
        self.draft = self._load_draft(config, model_config)
        # the CPU's thread count per step, measured (see thread_tuner.py); None elsewhere
        self.thread_tuner = make_thread_tuner(platform, get_tp_size())
        platform.empty_cache()  # what the warm-up steps and captures freed, before measuring
        logger.info(
            "model %s (%s implementation), device %s, attention %s, runner %s; weights %.0f "
            "MiB (%s), KV cache %.0f MiB (resident as its blocks are first used), process "
            "resident %s",
            type(self.model).__name__,
            getattr(self.model, "model_impl", "pyxllm"),
            self.device,
            type(self.attn_backend).__name__,
            self.runner.name,
            weight_bytes(self.model) / 2**20,
            self.quantization or f"{str(self.dtype).removeprefix('torch.')}, not quantized",
            self.kv_spec.bytes_per_block * self.num_kv_blocks / 2**20,
            _resident_memory(),
        )

    def _make_batch_invariant(self, backend_cls) -> None:
        """``--batch-invariant``: the attention backend computes every token alike where it can
        (the quantized layers were told by ``quantize_model``); the log names what is not
        covered: matmuls without a row-invariant kernel (float weights on BLAS, W8A8) and an
        attention backend without the mode."""
        attention = getattr(backend_cls, "supports_batch_invariance", False)
        if attention:
            self.attn_backend.batch_invariant = True
        uncovered = []
        matmuls = sum(
            1
            for m in self.model.modules()
            if getattr(m, "quantizable", False)
            and not getattr(getattr(m, "quant_method", None), "batch_invariant", False)
        )
        if matmuls:
            uncovered.append(f"{matmuls} matmuls without a row-invariant kernel")
        if not attention:
            uncovered.append(f"attention {backend_cls.__name__}")
        if uncovered:
            logger.info(
                "--batch-invariant: not covered: %s; a request's tokens may depend on what "
                "else runs beside it",
                ", ".join(uncovered),
            )

    def _load_draft(self, config: EngineConfig, model_config) -> DraftModel | None:
        """The draft model of ``--speculative-config``, if its method is ``draft_model``.

        Under tensor parallelism the draft is split over the TP ranks as the target is.

        Raises:
            ValueError: a draft with another vocabulary, or one whose heads do not split over
                the TP ranks.
        """
        spec = config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        return DraftModel(spec.model, model_config, self)

    def make_context(self, batch: InputBatch) -> ForwardContext:
        """The forward context of one step: the backend's metadata for ``batch``, the caches,
        and the step's LoRA adapters (set by :meth:`execute`)."""
        return ForwardContext(
            attn=self.attn_backend.build(batch),
            kv_caches=self.kv_caches,
            lora=self._lora_step,
            multimodal=self._mm_step,
        )

    def read_kv_block(self, block_id: int) -> bytes:
        """One KV block's bytes, every layer's K then V rows as the cache holds them (the
        payload of ``--kv-offload-dir``'s files)."""
        parts = [cache[block_id].reshape(-1) for pair in self.kv_caches for cache in pair]
        return torch.cat(parts).view(torch.uint8).cpu().numpy().tobytes()

    def write_kv_block(self, block_id: int, payload: bytes) -> None:
        """Put a block read by :meth:`read_kv_block` (from the same model and settings) back
        into block ``block_id``.

        Raises:
            ValueError: a payload of another size.
        """
        caches = [cache for pair in self.kv_caches for cache in pair]
        total = sum(c[block_id].numel() * c.element_size() for c in caches)
        if len(payload) != total:
            raise ValueError(f"KV block payload: {len(payload)} bytes, expected {total}")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        start = 0
        for cache in caches:
            target = cache[block_id]
            size = target.numel() * target.element_size()
            target.copy_(data[start : start + size].view(cache.dtype).view(target.shape))
            start += size

    def add_lora(self, request: LoRARequest) -> bool:
        """Load a LoRA adapter (``False`` when it is loaded already).

        Raises:
            ValueError: the engine runs without ``--enable-lora``;
                ``pyxllm.lora.adapter.LoRAAdapterError`` for an adapter it cannot serve.
        """
        if self.lora is None:
            raise ValueError("LoRA adapters need --enable-lora (LLM(enable_lora=True))")
        return self.lora.add(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a loaded LoRA adapter (``False`` when it was not loaded)."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Run one forward pass over ``plan`` and sample where the plan says so (with a draft
        model, it first fills the plan's draft placeholders)."""
        if self.draft is not None:
            self.draft.propose(plan)
        batch = InputBatch.build(plan, self.config.block_size, self.device)
        if self.lora is not None:
            self._lora_step = self.lora.step(
                [s.lora_request for s in plan.sequences], batch.query_lens
            )
            if hasattr(self.runner, "lora_step"):  # the graph runner's replays take it
                self.runner.lora_step = self._lora_step
        if self.encoder_cache is not None:  # the encoder step: each new image once
            self._mm_step = self.encoder_cache.step_embeddings(plan, batch.query_start_list)
        if self.thread_tuner is None:
            return self._run(plan, batch)
        with self.thread_tuner.step(tuner_key(batch, self._lora_step)):
            return self._run(plan, batch)

    def _run(self, plan: SchedulerOutput, batch: InputBatch) -> StepResult:
        """The forward pass over ``batch`` (``plan``'s inputs), then sampling (or, for the
        embed task, pooling each whole prompt)."""
        hidden_states = self.runner.execute(batch, self.make_context)
        if self.pooler is not None:
            pooled = pool_sequences(self.pooler, plan, hidden_states, batch.query_lens)
            return StepResult([[] for _ in plan.sequences], pooled=pooled)
        result = StepResult([[] for _ in plan.sequences])
        rows = [i for i, s in enumerate(plan.sequences) if s.sample]
        if rows:
            logits = self.model.compute_logits(hidden_states.index_select(0, batch.logits_indices))
            if logits is None:  # a TP worker: logits were gathered to rank 0, which samples
                rows = []
        if rows:
            self._sample(logits, [plan.sequences[i] for i in rows], rows, result)
        if any(s.prompt_logprob_targets for s in plan.sequences):
            result.prompt_logprobs = self._prompt_logprobs(plan, batch, hidden_states)
        return result

    def _sample(
        self, logits: torch.Tensor, seqs: list, rows: list[int], result: StepResult
    ) -> None:
        """Sample ``seqs`` (the plan's sequences at ``rows``) from their ``logits`` rows, verify
        their speculative drafts (:mod:`pyxllm.executor.spec_decode`), and put the emitted
        tokens and their logprobs into ``result``."""
        sampling_rows, counts = expand_for_verification(seqs)
        rewind = GeneratorRewind(seqs)
        vocab_size = logits.shape[-1]
        out = self.sampler.sample(
            logits, SamplingMetadata.build(sampling_rows, vocab_size, self.device)
        )
        emitted = accept_drafts(seqs, counts, out.token_ids.tolist())
        rewind.rewind(seqs, emitted, vocab_size)
        for row, tokens in zip(rows, emitted):
            result.sampled_token_ids[row] = tokens
        if out.logprobs is None:
            return
        result.logprobs = [None] * len(result.sampled_token_ids)
        entries = iter(out.logprobs.tolists())  # one per sampling row that asked, in order
        for row, seq, count, tokens in zip(rows, seqs, counts, emitted):
            k = seq.sampling_params.logprobs
            if k is None:
                continue
            positions = [next(entries) for _ in range(count)]
            result.logprobs[row] = [
                (ids[: 1 + k], values[: 1 + k], rank) for ids, values, rank in positions
            ][: len(tokens)]

    def _prompt_logprobs(
        self, plan: SchedulerOutput, batch: InputBatch, hidden_states: torch.Tensor
    ) -> list:
        """Logprobs of the raw model distribution (no penalty or temperature) at every prompt
        position whose next prompt token the plan asks about; logits only for those positions.
        With ``prompt_logprobs=-1`` a sequence gets the float32 log-softmax rows themselves
        (moved to the CPU), the same values the top-k path gathers from."""
        out: list[list[TokenLogprobs] | torch.Tensor | None] = [None] * len(plan.sequences)
        for i, seq in enumerate(plan.sequences):
            targets = seq.prompt_logprob_targets
            if targets:
                start = batch.query_start_list[i]
                logits = self.model.compute_logits(hidden_states[start : start + len(targets)])
                if logits is None:  # a TP worker: only rank 0 gets logits
                    continue
                num_top = seq.sampling_params.prompt_logprobs
                if num_top == FULL_VOCAB_LOGPROBS:
                    out[i] = logits.float().log_softmax(dim=-1).cpu()
                    continue
                target_ids = torch.tensor(targets, device=logits.device)
                out[i] = compute_logprobs(logits.float(), target_ids, num_top).tolists()
        return out


def _text_config(model_config):
    """A vision-language model's ``text_config``, else ``model_config`` itself."""
    get = getattr(model_config, "get_text_config", None)
    return model_config if get is None else get()


def _embedding_checkpoint_name(name: str) -> str | None:
    """A decoder embedding checkpoint's tensor name as the causal LM class has it: one saved
    from the base model (Qwen3-Embedding's ``layers.0.self_attn...``, ``norm.weight``) gets
    ``model.``; its LM head, if stored, is skipped (``None``)."""
    if name.startswith("lm_head."):
        return None
    return name if name.startswith("model.") else f"model.{name}"
