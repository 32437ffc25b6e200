"""The executor of the pooling tasks on an encoder (``--task embed``, ``score``, ``classify``):
an encoder model and a pooler instead of a KV cache, attention backend, runner and sampler.

The engine schedules embedding requests as it schedules generation (continuous batching, the
same token and sequence budgets), each a prompt computed whole in one step with no prefix cache
(see ``LLMEngine``); this executor runs such steps. Why not :class:`ModelExecutor`: an encoder's
attention is bidirectional over the whole prompt and keeps nothing for later steps, so the paged
KV cache, its attention backends (causal over cached blocks), the graph runners (decode steps)
and the sampler have nothing to do; an encoder step is the model's forward over whole sequences
(:class:`~pyxllm.attention.encoder.EncoderAttentionStep`) and one pooled vector per sequence:
an embedding, or a classifier's activated outputs (a cross-encoder's one score).
"""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from pyxllm.attention.encoder import EncoderAttentionStep
from pyxllm.config import EngineConfig
from pyxllm.executor.input_batch import InputBatch
from pyxllm.executor.model_executor import StepResult, resolve_dtype
from pyxllm.executor.pooling import pool_sequences, token_type_ids
from pyxllm.executor.scheduler_output import SchedulerOutput
from pyxllm.executor.thread_tuner import make_thread_tuner
from pyxllm.layers.forward_context import ForwardContext, set_forward_context
from pyxllm.layers.pooler import ClassifierPooler, Pooler, classifier_activation
from pyxllm.models.build_context import build_model
from pyxllm.models.registry import resolve_model_class
from pyxllm.models.weight_loading import load_weights
from pyxllm.platforms import Platform
from pyxllm.weights import ModelSource, iter_weight_slices
from pyxllm.weights.pooling_config import load_pooling_config

logger = logging.getLogger(__name__)


class PoolingExecutor:
    """Loads an encoder model and its pooler, and runs embed steps in this process (an
    :class:`~pyxllm.executor.abstract.Executor`; one rank, so ``failure`` stays ``None``).

    Attributes:
        num_kv_blocks: the block count the engine's scheduler books prompts against: enough
            for ``--max-seqs-per-batch`` prompts of ``max_model_len`` tokens (bookkeeping
            only: no cache memory exists, so nothing is ever preempted).
        hidden_size: the length of a whole embedding.
        pooler: the model's pooling (sentence-transformers' modules, else the model's default;
            for a classifier, its head and activation: see
            :func:`~pyxllm.layers.pooler.classifier_activation`).

    Raises:
        ValueError: an unsupported architecture, a bad checkpoint, an unsupported pooling
            mode (``ModelLoadError``) or classifier activation.
    """

    def __init__(
        self, config: EngineConfig, model_config, source: ModelSource, platform: Platform
    ) -> None:
        self.config, self.model_config = config, model_config
        self.device = platform.set_device(platform.device_index(0))
        self.dtype = resolve_dtype(config.dtype, platform, model_config)
        model_cls = resolve_model_class(model_config, platform.name, config.model_impl)
        self.model = build_model(model_cls, model_config, self.device, self.dtype, None)
        weights = tqdm(
            iter_weight_slices(source, model_config),
            desc="Loading weights",
            unit=" tensors",
            leave=False,
            disable=None,
        )
        load_weights(self.model, weights)
        if hasattr(self.model, "classify"):  # --task score or classify
            activation = classifier_activation(model_config, config.task)
            self.pooler = ClassifierPooler(self.model.classify, activation)
            pooling = f"a classifier of {model_config.num_labels} labels, {activation}"
        else:
            directory = source.path if source.kind == "hf" else None
            pooling_config = load_pooling_config(directory, model_cls.default_pooling_type)
            self.pooler = Pooler(pooling_config.pooling_type, pooling_config.normalize)
            pooling = f"{pooling_config.pooling_type.lower()} pooling" + (
                ", normalized" if pooling_config.normalize else ""
            )
        self.hidden_size = model_config.hidden_size
        max_len = config.max_model_len or model_config.max_position_embeddings
        self.num_kv_blocks = config.max_seqs_per_batch * -(-max_len // config.block_size)
        self.failure: str | None = None
        self.driver = self
        # the CPU's thread count per step, measured (see thread_tuner.py); None elsewhere
        self.thread_tuner = make_thread_tuner(platform, 1)
        logger.info(
            "%s model %s, device %s, dtype %s, %s, %d dimensions",
            config.task,
            type(self.model).__name__,
            self.device,
            str(self.dtype).removeprefix("torch."),
            pooling,
            self.hidden_size,
        )

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Encode ``plan``'s sequences (each a whole prompt, positions from 0, token types
        from their ``pooling_params.token_type_start``) and pool each into its embedding, cut
        to its ``pooling_params.dimensions`` and normalized as it asks, or for a classifier into
        its activated outputs; no token is sampled.

        Raises:
            ValueError: a sequence that is not a whole prompt (see :func:`pool_sequences`).
        """
        batch = InputBatch.build(plan, self.config.block_size, self.device)
        if self.thread_tuner is None:
            return self._run(plan, batch)
        # steps are timed by their token count rounded up to a power of two (within 2x of
        # each other), since every embed step is a prefill of its own length
        with self.thread_tuner.step(1 << (batch.input_ids.numel() - 1).bit_length()):
            return self._run(plan, batch)

    def _run(self, plan: SchedulerOutput, batch: InputBatch) -> StepResult:
        """The encoder's forward over ``batch`` (``plan``'s inputs), then pooling."""
        context = ForwardContext(EncoderAttentionStep(batch.query_lens, self.device), [])
        types = token_type_ids(plan, batch.query_lens, batch.input_ids.numel(), self.device)
        with set_forward_context(context):
            hidden_states = self.model(batch.input_ids, batch.positions, types)
        pooled = pool_sequences(self.pooler, plan, hidden_states, batch.query_lens)
        return StepResult([[] for _ in plan.sequences], pooled=pooled)

    def check_health(self) -> None:
        """Always healthy: there is no other process to lose."""

    def shutdown(self) -> None:
        """Nothing to stop."""
