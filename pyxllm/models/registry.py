"""Which architectures pyxllm runs, on which platforms, and where their classes live.

The support matrix is data, checked before any model module is imported (xLLM's registry).
Architectures without a native class run through transformers' model code
(:mod:`pyxllm.models.transformers_backend`), chosen by ``--model-impl``.
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
    "Gemma2ForCausalLM": RegisteredModel("pyxllm.models.gemma3", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": RegisteredModel("pyxllm.models.gemma3", "Gemma3ForCausalLM"),
    # vision-language: transformers' CLIP tower, our projector and Llama (see docs/multimodal.md)
    "LlavaForConditionalGeneration": RegisteredModel(
        "pyxllm.models.llava", "LlavaForConditionalGeneration"
    ),
    # SmolVLM, SmolVLM2: transformers' vision tower and connector, our Llama
    "Idefics3ForConditionalGeneration": RegisteredModel(
        "pyxllm.models.idefics3", "Idefics3ForConditionalGeneration"
    ),
    "SmolVLMForConditionalGeneration": RegisteredModel(
        "pyxllm.models.idefics3", "SmolVLMForConditionalGeneration"
    ),
    # Qwen2-VL, Qwen2.5-VL: transformers' vision tower, our Qwen2 with mRoPE
    "Qwen2VLForConditionalGeneration": RegisteredModel(
        "pyxllm.models.qwen2_vl", "Qwen2VLForConditionalGeneration"
    ),
    "Qwen2_5_VLForConditionalGeneration": RegisteredModel(
        "pyxllm.models.qwen2_vl", "Qwen2_5_VLForConditionalGeneration"
    ),
    # Qwen3-VL (dense): our Qwen3 with interleaved mRoPE, deepstack features
    "Qwen3VLForConditionalGeneration": RegisteredModel(
        "pyxllm.models.qwen2_vl", "Qwen3VLForConditionalGeneration"
    ),
    # Gemma 3 4B-27B with images: transformers' SigLIP tower and projector, our Gemma 3; image
    # tokens attend bidirectionally within their image
    "Gemma3ForConditionalGeneration": RegisteredModel(
        "pyxllm.models.gemma3_mm", "Gemma3ForConditionalGeneration"
    ),
    # encoders for the embed task (sentence-transformers' all-MiniLM-L6-v2)
    "BertModel": RegisteredModel("pyxllm.models.bert", "BertModel"),
    # cross-encoders and classifiers for the score and classify tasks
    "BertForSequenceClassification": RegisteredModel(
        "pyxllm.models.bert", "BertForSequenceClassification"
    ),
}
# encoders, which pool rather than generate: run by the pooling executor
POOLING_ARCHITECTURES = frozenset({"BertModel", "BertForSequenceClassification"})
# models that read images beside text: their prompts carry multimodal items (see
# pyxllm.multimodal_inputs); transformers' backend runs none of them
MULTIMODAL_ARCHITECTURES = frozenset(
    {
        "LlavaForConditionalGeneration",
        "Idefics3ForConditionalGeneration",
        "SmolVLMForConditionalGeneration",
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Gemma3ForConditionalGeneration",
    }
)
# encoders with a sequence-classification head: --task score (one label: a cross-encoder) or
# --task classify
CLASSIFIER_ARCHITECTURES = frozenset({"BertForSequenceClassification"})


def _archs(config) -> list[str]:
    return list(getattr(config, "architectures", None) or [])


def is_encoder(config) -> bool:
    """Whether ``config.architectures`` names an encoder of :data:`POOLING_ARCHITECTURES`."""
    return any(arch in POOLING_ARCHITECTURES for arch in _archs(config))


def is_classifier(config) -> bool:
    """Whether ``config.architectures`` names a classifier of :data:`CLASSIFIER_ARCHITECTURES`
    (a cross-encoder when ``config.num_labels`` is 1)."""
    return any(arch in CLASSIFIER_ARCHITECTURES for arch in _archs(config))


def is_multimodal(config) -> bool:
    """Whether ``config.architectures`` names a model of :data:`MULTIMODAL_ARCHITECTURES`."""
    return any(arch in MULTIMODAL_ARCHITECTURES for arch in _archs(config))


def check_task(config, task: str) -> None:
    """Check that ``config.architectures`` runs the engine task ``task``, before any model
    module is imported: ``embed`` takes an encoder without a classification head or one of
    pyxllm's own decoders (an embedding model such as Qwen3-Embedding, pooled from its hidden
    states); ``score`` and ``classify`` take a classifier (``*ForSequenceClassification``);
    ``generate`` takes anything but an encoder.

    Raises:
        ValueError: naming the architecture and the ``--task`` that fits: an encoder for
            ``generate``, a classifier for ``embed``, anything else for ``score`` and
            ``classify``, or for ``embed`` a model pyxllm has no code of its own for.
    """
    archs = _archs(config)
    named = ", ".join(archs) or "(none)"
    classifier, pooling = is_classifier(config), is_encoder(config)
    if task in ("score", "classify") and not classifier:
        raise ValueError(
            f"--task {task}: architecture {named} has no classification head; cross-encoders "
            f"and classifiers: {', '.join(sorted(CLASSIFIER_ARCHITECTURES))} (an embedding "
            "model scores by cosine similarity with --task embed)"
        )
    if task == "embed" and classifier:
        raise ValueError(
            f"--task embed: architecture {named} is a classifier; serve it with --task score "
            "(a cross-encoder) or --task classify"
        )
    if task == "embed" and not pooling and not any(arch in MODEL_REGISTRY for arch in archs):
        raise ValueError(
            f"--task embed: architecture {named} has no pooling in pyxllm; "
            f"embedding models: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    if task == "generate" and pooling:
        fits = "--task score or --task classify" if classifier else "--task embed"
        kind = "scores or classes" if classifier else "embeddings"
        raise ValueError(
            f"architecture {named} is an encoder that makes {kind}, not text: serve it with {fits}"
        )


def supported_architectures() -> list[str]:
    """Every architecture name pyxllm can run, sorted."""
    return sorted(MODEL_REGISTRY)


def resolve_model_class(config, platform: str, model_impl: str = "auto") -> type:
    """The model class for ``config.architectures`` on ``platform``, by ``--model-impl``.

    ``pyxllm``: the native class of :data:`MODEL_REGISTRY`; ``transformers``:
    :class:`~pyxllm.models.transformers_backend.TransformersForCausalLM`; ``auto``: the native
    class where there is one, else transformers' (vLLM's order).

    Raises:
        ValueError: no implementation runs the architecture (naming it, the native ones, and why
            transformers cannot), the native one does not run on this platform, or
            ``transformers`` for a vision-language model.
    """
    archs = list(getattr(config, "architectures", None) or [])
    native = next((arch for arch in archs if arch in MODEL_REGISTRY), None)
    if model_impl == "transformers" and native in MULTIMODAL_ARCHITECTURES:
        raise ValueError(
            f"--model-impl transformers: {native} reads images, which only pyxllm's own "
            "implementation feeds (use --model-impl auto or pyxllm)"
        )
    if native is not None and model_impl != "transformers":
        module, cls, platforms = MODEL_REGISTRY[native]
        if platforms is not None and platform not in platforms:
            raise ValueError(
                f"architecture {native} is not supported on device {platform}; it runs on "
                f"{', '.join(sorted(platforms))}"
            )
        return getattr(importlib.import_module(module), cls)
    unsupported = (
        f"unsupported model architecture {', '.join(archs) or '(none given in config.json)'}; "
        f"pyxllm's own implementations: {', '.join(supported_architectures())}"
    )
    if model_impl == "pyxllm":
        raise ValueError(f"{unsupported} (--model-impl transformers runs others)")
    # lazy: the transformers backend (and transformers) load only for a model pyxllm lacks
    from pyxllm.models.transformers_backend import TransformersForCausalLM, transformers_class

    try:
        transformers_class(config)
    except ValueError as e:
        if model_impl == "transformers":
            raise
        raise ValueError(f"{unsupported}; {e}") from None
    return TransformersForCausalLM
