"""Which engine task a model runs when ``--task auto`` leaves it to the model (vLLM's
``--runner auto``): a cross-encoder scores, a classifier classifies, another encoder embeds,
anything else generates. Apart from the executor
factory so that the engine's front door (which loads no weights) can ask without importing
the executors."""

from __future__ import annotations

from pyxllm.models.registry import is_classifier, is_encoder


def resolve_task(model_config, task: str) -> str:
    """``task`` itself unless it is ``auto``; then for a ``*ForSequenceClassification``
    encoder ``score`` when it has one label (a cross-encoder, as vLLM picks it) and ``classify``
    when it has several, ``embed`` for another encoder (``BertModel``), else ``generate``."""
    if task != "auto":
        return task
    if is_classifier(model_config):
        return "score" if getattr(model_config, "num_labels", 1) == 1 else "classify"
    return "embed" if is_encoder(model_config) else "generate"
