"""What an engine's front door needs of a model, without its weights: the checkpoint's config,
the context limit, the generation defaults, the tokenizer and the served names.

:class:`LLMEngine` builds its :class:`InputProcessor` from an :class:`EngineFrontend`; so does
the data-parallel front (:mod:`pyxllm.engine.data_parallel`), which serves several engine
replicas from one API process that never loads the model itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pyxllm.config import EngineConfig, load_chat_template
from pyxllm.engine.input_processor import InputProcessor
from pyxllm.engine.multimodal import MultiModalProcessor, parse_mm_limits
from pyxllm.engine.structured_output import StructuredOutputManager
from pyxllm.engine.tokenizer import Tokenizer
from pyxllm.executor.tasks import resolve_task
from pyxllm.multimodal_inputs import MediaPolicy
from pyxllm.pooling_params import POOLING_TASKS
from pyxllm.weights import (
    load_generation_defaults,
    load_hf_tokenizer,
    load_model_config,
    resolve_model_source,
    resolve_tokenizer_source,
)
from pyxllm.weights.pooling_config import load_pooling_config


def resolve_max_model_len(config: EngineConfig, model_config) -> int:
    """The context limit in tokens: ``--max-model-len``, else the model's
    ``max_position_embeddings`` (for the embed task, see :meth:`EngineFrontend.load`: capped to
    sentence-transformers' ``max_seq_length``).

    Raises:
        ValueError: the flag exceeds the model's limit, or neither is known (naming the flag).
    """
    model_max = getattr(text_config_of(model_config), "max_position_embeddings", None)
    if config.max_model_len is None:
        if model_max is None:
            raise ValueError(
                "--max-model-len: the model config has no max_position_embeddings; set the flag"
            )
        return model_max
    if model_max is not None and config.max_model_len > model_max:
        raise ValueError(
            f"--max-model-len: {config.max_model_len} exceeds the model's max_position_embeddings "
            f"({model_max})"
        )
    return config.max_model_len


def text_config_of(model_config):
    """The language model's config: a vision-language model's ``text_config`` (where
    ``vocab_size``, ``max_position_embeddings`` and ``hidden_size`` live), else the config."""
    get = getattr(model_config, "get_text_config", None)
    return model_config if get is None else get()


def _with_task(config: EngineConfig, task: str) -> EngineConfig:
    """``config`` running ``task``; for a pooling task (``embed``, ``score``, ``classify``)
    every step computes whole prompts (no chunked prefill, no prefix cache: an encoder's
    attention runs both ways, and pooling needs every token of the prompt in the step) on the
    eager runner (there are no decode steps to capture).

    Raises:
        ValueError: a flag a pooling task cannot honour, naming it (``EngineConfig`` checks
            them).
    """
    if task in POOLING_TASKS:
        return dataclasses.replace(
            config,
            task=task,
            enable_chunked_prefill=False,
            enable_prefix_cache=False,
            graph_backend="eager",
        )
    return config if task == config.task else dataclasses.replace(config, task=task)


@dataclass(slots=True)
class EngineFrontend:
    """The model's config, context limit, request defaults, tokenizer and names (see
    :meth:`load`).

    Attributes:
        config: the engine configuration it was loaded for, its ``task`` resolved (see
            :meth:`load`).
        source: where the model is (``pyxllm.weights.ModelSource``).
        model_config: the checkpoint's config (``vocab_size``, ``max_position_embeddings`` ...).
        max_model_len: the context limit in tokens.
        defaults: the model's generation defaults (``pyxllm.weights.GenerationDefaults``).
        tokenizer: the model's (or ``--tokenizer``'s) tokenizer and chat template.
        served_model_names: the names clients may send as ``model``; the first is reported.
    """

    config: EngineConfig
    source: object
    model_config: object
    max_model_len: int
    defaults: object
    tokenizer: Tokenizer
    served_model_names: tuple[str, ...]

    @classmethod
    def load(cls, config: EngineConfig) -> EngineFrontend:
        """Resolve the model (downloading a model id's files when they are not cached) and
        load its config and tokenizer, not its weights. ``--task auto`` is resolved for the
        model; the loaded :attr:`config` says the task (for ``embed``: no chunked prefill, no
        prefix cache, the eager runner).

        Raises:
            ValueError: a model that cannot be found, a bad ``--max-model-len``, a token
                budget a whole prompt cannot fit without chunked prefill, or a flag the
                resolved task cannot honour (naming the flag).
        """
        parse_mm_limits(config.limit_mm_per_prompt)  # a bad flag fails before any loading
        source = resolve_model_source(
            config.model, config.revision, config.download_dir, config.gguf_file, config.task
        )
        model_config = load_model_config(source)
        config = _with_task(config, resolve_task(model_config, config.task))
        max_model_len = resolve_max_model_len(config, model_config)
        if config.task in POOLING_TASKS and config.max_model_len is None and source.kind == "hf":
            # sentence-transformers' max_seq_length, as vLLM takes it: what the model embeds
            seq_len = load_pooling_config(source.path, "CLS").max_seq_length
            max_model_len = min(max_model_len, seq_len or max_model_len)
        budget = config.token_budget(max_model_len)
        if not config.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"--max-tokens-per-batch: {budget} is below --max-model-len "
                f"({max_model_len}); without chunked prefill a whole prompt must fit one step"
            )
        defaults = load_generation_defaults(source, model_config, config.generation_config)
        tokenizer_source = source
        if config.tokenizer is not None:  # --tokenizer: another directory, GGUF file or model id
            tokenizer_source = resolve_tokenizer_source(
                config.tokenizer, config.tokenizer_revision, config.download_dir
            )
        hf_tokenizer = load_hf_tokenizer(tokenizer_source)
        if config.chat_template is not None:
            hf_tokenizer.chat_template = load_chat_template(config.chat_template)
        tokenizer = Tokenizer(hf_tokenizer, defaults.eos_token_ids)
        # clients may send any of served_model_names as "model"; responses report the first
        names = config.served_model_names or (source.name,)
        return cls(config, source, model_config, max_model_len, defaults, tokenizer, names)

    @property
    def model_name(self) -> str:
        """The name responses report (the first served name)."""
        return self.served_model_names[0]

    def structured_output_manager(self) -> StructuredOutputManager:
        """A grammar compiler for this model's vocabulary (``--structured-outputs-backend``)."""
        return StructuredOutputManager(
            self.config.structured_outputs_backend,
            self.tokenizer.hf,
            text_config_of(self.model_config).vocab_size,
            self.tokenizer.eos_token_ids,
        )

    def input_processor(
        self, max_kv_blocks: int, structured_outputs: StructuredOutputManager | None
    ) -> InputProcessor:
        """The front door for an engine whose KV cache has ``max_kv_blocks`` blocks."""
        return InputProcessor(
            self.tokenizer,
            vocab_size=text_config_of(self.model_config).vocab_size,
            max_model_len=self.max_model_len,
            max_kv_blocks=max_kv_blocks,
            block_size=self.config.block_size,
            generation_defaults=self.defaults.sampling,
            structured_outputs=structured_outputs,
            embedding_size=self.model_config.hidden_size if self.config.task == "embed" else None,
            class_labels=self.class_labels,
            multimodal=MultiModalProcessor.load(
                self.source.path if self.source.kind == "hf" else None,
                self.model_config,
                self.tokenizer.hf,
                parse_mm_limits(self.config.limit_mm_per_prompt),
                MediaPolicy(
                    self.config.allowed_local_media_path,
                    self.config.fetch_media,
                    self.config.allowed_media_domains,
                ),
            ),
            kv_transfer=self.config.kv_offload_dir is not None,
        )

    @property
    def class_labels(self) -> tuple[str, ...] | None:
        """A classifier's label names by class index (``id2label``, ``LABEL_<i>`` where it
        names none) for the score and classify tasks, else ``None``."""
        if self.config.task not in ("score", "classify"):
            return None
        id2label = getattr(self.model_config, "id2label", None) or {}
        num_labels = getattr(self.model_config, "num_labels", len(id2label))
        return tuple(
            str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels)
        )
