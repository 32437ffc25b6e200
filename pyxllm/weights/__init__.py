"""Finding a model and reading its config, tokenizer, generation defaults and weights.

A model is the embedded SmolLM2-135M-Instruct GGUF (``model=None``), a ``.gguf`` file, a
local Hugging Face directory (``config.json`` + ``*.safetensors``), or a Hugging Face model id
(``ORG/NAME``, from the Hugging Face cache or downloaded into it), or a ``.gguf`` inside either;
its tokenizer may come from elsewhere (:func:`resolve_tokenizer_source`). Every problem raises
:class:`ModelLoadError` with a message naming the file and the fix.

The names load on first use (the loaders need torch; finding a model does not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyxllm.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from pyxllm.weights.errors import ModelLoadError
    from pyxllm.weights.gguf_loader import GGUF_ARCHITECTURES
    from pyxllm.weights.lazy import LazyWeight
    from pyxllm.weights.loader import (
        GenerationDefaults,
        iter_weight_slices,
        iter_weights,
        load_generation_defaults,
        load_hf_tokenizer,
        load_model_config,
    )
    from pyxllm.weights.source import (
        ModelSource,
        default_gguf_path,
        is_model_id,
        resolve_model_source,
        resolve_tokenizer_source,
    )

_EXPORTS = {
    "GGUF_ARCHITECTURES": "pyxllm.weights.gguf_loader",
    "GenerationDefaults": "pyxllm.weights.loader",
    "LazyWeight": "pyxllm.weights.lazy",
    "ModelLoadError": "pyxllm.weights.errors",
    "ModelSource": "pyxllm.weights.source",
    "default_gguf_path": "pyxllm.weights.source",
    "iter_weight_slices": "pyxllm.weights.loader",
    "is_model_id": "pyxllm.weights.source",
    "iter_weights": "pyxllm.weights.loader",
    "load_generation_defaults": "pyxllm.weights.loader",
    "load_hf_tokenizer": "pyxllm.weights.loader",
    "load_model_config": "pyxllm.weights.loader",
    "resolve_model_source": "pyxllm.weights.source",
    "resolve_tokenizer_source": "pyxllm.weights.source",
}
__all__ = [
    "GGUF_ARCHITECTURES",
    "GenerationDefaults",
    "LazyWeight",
    "ModelLoadError",
    "ModelSource",
    "default_gguf_path",
    "iter_weight_slices",
    "is_model_id",
    "iter_weights",
    "load_generation_defaults",
    "load_hf_tokenizer",
    "load_model_config",
    "resolve_model_source",
    "resolve_tokenizer_source",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
