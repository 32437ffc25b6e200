"""Which architectures pyxllm runs, on which platforms, and where their classes live.

The support matrix is data, checked before any model module is imported (xLLM's registry).
"""

from __future__ import annotations

import importlib
from typing import NamedTuple


class RegisteredModel(NamedTuple):
    """Where an architecture's class lives, and the platforms it runs on (by ``--device`` name;
    ``None``: every platform)."""

    module: str
    class_name: str
    platforms: frozenset[str] | None = None


# architecture (config.json "architectures"[0]) -> its class
MODEL_REGISTRY: dict[str, RegisteredModel] = {
    "LlamaForCausalLM": RegisteredModel("pyxllm.models.llama", "LlamaForCausalLM"),
    # Llama's weights and layers; the config's sliding window applies to every layer
    "MistralForCausalLM": RegisteredModel("pyxllm.models.llama", "LlamaForCausalLM"),
    # Phi-3, Phi-3.5-mini, Phi-4-mini: fused qkv/gate_up, partial rotary, LongRoPE
    "Phi3ForCausalLM": RegisteredModel("pyxllm.models.phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": RegisteredModel("pyxllm.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": RegisteredModel("pyxllm.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": RegisteredModel("pyxllm.models.qwen3_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    """Every architecture name pyxllm can run, sorted."""
    return sorted(MODEL_REGISTRY)


def resolve_model_class(config, platform: str) -> type:
    """The model class for ``config.architectures`` on ``platform``.

    Raises:
        ValueError: the architecture is unknown (naming it and the supported ones) or not
            supported on this platform.
    """
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            module, cls, platforms = MODEL_REGISTRY[arch]
            if platforms is not None and platform not in platforms:
                raise ValueError(
                    f"architecture {arch} is not supported on device {platform}; it runs on "
                    f"{', '.join(sorted(platforms))}"
                )
            return getattr(importlib.import_module(module), cls)
    raise ValueError(
        f"unsupported model architecture {', '.join(archs) or '(none given in config.json)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )
