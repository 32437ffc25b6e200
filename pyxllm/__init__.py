"""pyxllm: a Python-native LLM inference and serving engine.

``from pyxllm import LLM, SamplingParams`` for offline use; ``pyxllm serve`` for the
OpenAI-compatible server.
"""

from pyxllm.entrypoints.llm import LLM
from pyxllm.outputs import CompletionOutput, RequestOutput
from pyxllm.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]
