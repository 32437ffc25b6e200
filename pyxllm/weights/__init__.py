"""Finding a model and reading its config, tokenizer, generation defaults and weights.

A model is the embedded SmolLM2-135M-Instruct GGUF (``model=None``), a ``.gguf`` file, a
local Hugging Face directory (``config.json`` + ``*.safetensors``), or a Hugging Face model id
(``ORG/NAME``, from the Hugging Face cache or downloaded into it), or a ``.gguf`` inside either;
its tokenizer may come from elsewhere (:func:`resolve_tokenizer_source`). Every problem raises
:class:`ModelLoadError` with a message naming the file and the fix.
"""

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
