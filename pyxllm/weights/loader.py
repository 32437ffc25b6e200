"""One entry point per thing a model brings: config, tokenizer, generation defaults, weights.

Each function takes a :class:`ModelSource` (or anything :func:`resolve_model_source` accepts)
and dispatches on its kind, so callers never branch on GGUF versus Hugging Face directories.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pyxllm.weights.errors import ModelLoadError
from pyxllm.weights.gguf_loader import gguf_config_dict, iter_gguf_weight_slices, iter_gguf_weights
from pyxllm.weights.gguf_reader import open_gguf
from pyxllm.weights.lazy import LazyWeight
from pyxllm.weights.safetensors_loader import iter_safetensors_slices, iter_safetensors_weights
from pyxllm.weights.source import (
    DEFAULT_MODEL_SAMPLING,
    ModelSource,
    default_gguf_path,
    resolve_model_source,
)

# generation_config.json key -> request default name (the keys vLLM takes as sampling defaults)
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# llama.cpp stops generation on any of these ("end of generation" tokens)
_GGUF_EOS_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)


def _as_source(source: ModelSource | str | Path | None) -> ModelSource:
    return source if isinstance(source, ModelSource) else resolve_model_source(source)


def load_model_config(source: ModelSource | str | Path | None) -> Any:
    """The model's ``transformers.PretrainedConfig``.

    HF directory: ``AutoConfig.from_pretrained(dir, local_files_only=True)``. GGUF: a config of
    the matching class built from the file's metadata (see :func:`gguf_config_dict`), with
    ``architectures`` set (e.g. ``["LlamaForCausalLM"]``) and ``tie_word_embeddings`` true
    exactly when the file has no ``output.weight``.

    Raises:
        ModelLoadError: unreadable or invalid config, unsupported GGUF architecture (the message
            lists the supported ones: ``GGUF_ARCHITECTURES``), truncated or corrupt GGUF file.
    """
    # lazy: transformers takes ~1 s to import; the engine's modules load without it
    from transformers import AutoConfig

    source = _as_source(source)
    if source.kind == "gguf":
        kwargs = gguf_config_dict(source.path)
        name_or_path = kwargs.pop("_name_or_path")
        config = AutoConfig.for_model(**kwargs)
        config.name_or_path = name_or_path
        return config
    try:
        return AutoConfig.from_pretrained(source.path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(
            f"{source.path / 'config.json'} could not be read as a transformers "
            f"config ({e}); fix or re-download it."
        ) from e


def load_hf_tokenizer(source: ModelSource | str | Path | None) -> Any:
    """The model's fast tokenizer (a ``transformers`` tokenizer), chat template included.

    HF directory: ``AutoTokenizer.from_pretrained(dir, local_files_only=True)``. GGUF:
    ``PreTrainedTokenizerFast.from_pretrained(parent, gguf_file=name)``, i.e. transformers'
    conversion of the ``tokenizer.ggml.*`` metadata; it gives the same ids and chat template as
    ``AutoTokenizer.from_pretrained(parent, gguf_file=name)`` without building a model config.

    Raises:
        ModelLoadError: the tokenizer files are missing or unreadable.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # lazy, as above

    source = _as_source(source)
    try:
        if source.kind == "gguf":
            open_gguf(source.path)  # a clear error for a corrupt file, before transformers reads it
            return PreTrainedTokenizerFast.from_pretrained(
                source.path.parent, gguf_file=source.path.name, local_files_only=True
            )
        return AutoTokenizer.from_pretrained(source.path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(
            f"The tokenizer of {source.path} could not be loaded ({e}); an HF directory "
            "needs tokenizer.json (or tokenizer files) next to config.json."
        ) from e


@dataclass(frozen=True)
class GenerationDefaults:
    """What the model says about generation, used as request defaults.

    Attributes:
        eos_token_ids: every end-of-sequence id, first-seen order, no duplicates: from
            ``config.eos_token_id``, ``generation_config.json``'s ``eos_token_id`` (int or list),
            and for GGUF ``tokenizer.ggml.eos_token_id`` / ``eot_token_id`` / ``eom_token_id``.
        sampling: request defaults from ``generation_config.json`` (as vLLM uses them):
            ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
            ``max_tokens`` (from ``max_new_tokens``), only those present. ``do_sample`` is not
            consulted, as in vLLM. Empty for GGUF files.
    """

    eos_token_ids: tuple[int, ...]
    sampling: dict[str, float | int] = field(default_factory=dict)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def load_generation_defaults(
    source: ModelSource | str | Path | None, config: Any, generation_config: str = "auto"
) -> GenerationDefaults:
    """Collect the EOS ids and sampling defaults of a model (see :class:`GenerationDefaults`).

    Args:
        source: the model.
        config: its config (from :func:`load_model_config`); its ``eos_token_id`` is included.
        generation_config: vLLM's ``--generation-config``: ``auto`` reads the model's
            ``generation_config.json``; ``vllm`` takes only its EOS ids, no sampling defaults;
            any other value is a directory whose ``generation_config.json`` is read instead of
            the model's (also for a GGUF model, which has none).

    Raises:
        ModelLoadError: a ``generation_config.json`` that is not a JSON object.
    """
    source = _as_source(source)
    eos = _ids(getattr(config, "eos_token_id", None))
    sampling: dict[str, float | int] = {}
    if source.kind == "gguf":
        meta = open_gguf(source.path).metadata
        for key in _GGUF_EOS_KEYS:
            eos += _ids(meta.get(key))
    if generation_config in ("auto", "vllm"):
        path = None if source.kind == "gguf" else source.path / "generation_config.json"
    else:
        path = Path(generation_config).expanduser() / "generation_config.json"
    if path is not None and path.is_file():
        try:
            generation = json.loads(path.read_text())
            if not isinstance(generation, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise ModelLoadError(
                f"{path} is not a valid generation config ({e}); fix or delete it."
            ) from e
        eos += _ids(generation.get("eos_token_id"))
        for key, name in _SAMPLING_KEYS.items() if generation_config != "vllm" else ():
            value = generation.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                sampling[name] = value
    elif generation_config == "auto" and source.kind == "gguf" and _is_default(source.path):
        sampling = dict(DEFAULT_MODEL_SAMPLING)
    return GenerationDefaults(tuple(dict.fromkeys(eos)), sampling)


def _is_default(path: Path) -> bool:
    """Whether ``path`` is the embedded default model's GGUF."""
    try:
        return path.resolve() == default_gguf_path().resolve()
    except ModelLoadError:  # the package is not installed
        return False


def iter_weights(
    source: ModelSource | str | Path | None, config: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every checkpoint tensor of the model as ``(hf_name, tensor)``, one at a time.

    Names are Hugging Face checkpoint names (``model.embed_tokens.weight``,
    ``model.layers.{i}.self_attn.q_proj.weight``, ..., ``model.norm.weight``, and
    ``lm_head.weight`` only when the checkpoint stores it). safetensors: dtype as stored.
    GGUF: dequantized to float32, llama Q/K rows un-permuted (see :mod:`gguf_loader`).
    ``config`` is the model's config (from :func:`load_model_config`).

    Raises:
        ModelLoadError: missing, truncated or corrupt weight files; an index naming a missing
            shard; an unsupported GGUF architecture or tensor.
    """
    source = _as_source(source)
    if source.kind == "gguf":
        return iter_gguf_weights(source.path, config)
    return iter_safetensors_weights(source.path)


def iter_weight_slices(
    source: ModelSource | str | Path | None, config: Any
) -> Iterator[tuple[str, LazyWeight]]:
    """As :func:`iter_weights`, but each tensor comes unread, as a :class:`LazyWeight`.

    A weight loader narrows it to this rank's rows or columns and reads only those (see
    :mod:`pyxllm.weights.lazy` for what GGUF and safetensors read). Each weight stays readable
    until the next one is requested.

    Raises:
        ModelLoadError: as :func:`iter_weights` (a corrupt file also when a weight is read).
    """
    source = _as_source(source)
    if source.kind == "gguf":
        return iter_gguf_weight_slices(source.path, config)
    return iter_safetensors_slices(source.path)
