"""Which architectures pyxllm runs, on which platforms, and where their classes live.

The support matrix is data, checked before any model module is imported (xLLM's registry).
"""

from __future__ import annotations

import importlib

ALL_PLATFORMS = frozenset({"cpu", "cuda", "npu", "mlu"})

# architecture (config.json "architectures"[0]) -> (module, class, platforms)
MODEL_REGISTRY: dict[str, tuple[str, str, frozenset[str]]] = {
    "LlamaForCausalLM": ("pyxllm.models.llama", "LlamaForCausalLM", ALL_PLATFORMS),
    "Qwen2ForCausalLM": ("pyxllm.models.qwen2", "Qwen2ForCausalLM", ALL_PLATFORMS),
    "Qwen3ForCausalLM": ("pyxllm.models.qwen3", "Qwen3ForCausalLM", ALL_PLATFORMS),
    "Qwen3MoeForCausalLM": ("pyxllm.models.qwen3_moe", "Qwen3MoeForCausalLM", ALL_PLATFORMS),
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
            if platform not in platforms:
                raise ValueError(
                    f"architecture {arch} is not supported on device {platform}; it runs on "
                    f"{', '.join(sorted(platforms))}"
                )
            return getattr(importlib.import_module(module), cls)
    raise ValueError(
        f"unsupported model architecture {', '.join(archs) or '(none given in config.json)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )
