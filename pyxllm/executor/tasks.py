"""Which engine task a model runs when ``--task auto`` leaves it to the model (vLLM's
``--runner auto``): an encoder embeds, anything else generates. Apart from the executor
factory so that the engine's front door (which loads no weights) can ask without importing
the executors."""

from __future__ import annotations

from pyxllm.models.registry import is_encoder


def resolve_task(model_config, task: str) -> str:
    """``task`` itself unless it is ``auto``; then ``embed`` for an encoder
    (``BertModel``), else ``generate``."""
    if task != "auto":
        return task
    return "embed" if is_encoder(model_config) else "generate"
