"""pyxllm: a Python-native LLM inference and serving engine.

``from pyxllm import LLM, SamplingParams`` for offline use; ``pyxllm serve`` for the
OpenAI-compatible server.

The names below load on first use, so that ``import pyxllm``, the command line's ``--help``
and the HTTP side's modules do not load torch until an engine is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyxllm.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from pyxllm.entrypoints.llm import LLM
    from pyxllm.lora_request import LoRARequest
    from pyxllm.outputs import (
        BeamSearchOutput,
        BeamSearchSequence,
        CompletionOutput,
        RequestOutput,
    )
    from pyxllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
_EXPORTS = {
    "LLM": "pyxllm.entrypoints.llm",
    "BeamSearchOutput": "pyxllm.outputs",
    "BeamSearchParams": "pyxllm.sampling_params",
    "BeamSearchSequence": "pyxllm.outputs",
    "LoRARequest": "pyxllm.lora_request",
    "CompletionOutput": "pyxllm.outputs",
    "RequestOutput": "pyxllm.outputs",
    "SamplingParams": "pyxllm.sampling_params",
    "StructuredOutputsParams": "pyxllm.sampling_params",
}
__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "LoRARequest",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
