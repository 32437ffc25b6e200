"""Engine settings a model reads while it is built (as vLLM's ``set_current_vllm_config``).

A model's constructor takes only its Hugging Face config; the few choices that depend on how the
engine runs it (today: the context length, which picks Phi-3's LongRoPE factors) come from here.
The executor builds its models with :func:`build_model`, inside :func:`model_build_context`; a
model built elsewhere (a test, the meta-device split check) gets the config's defaults.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

_MAX_MODEL_LEN: ContextVar[int | None] = ContextVar("pyxllm_max_model_len", default=None)


@contextmanager
def model_build_context(max_model_len: int | None) -> Iterator[None]:
    """Build models inside this block for a context of ``max_model_len`` tokens (``None``: the
    model's ``max_position_embeddings``)."""
    token = _MAX_MODEL_LEN.set(max_model_len)
    try:
        yield
    finally:
        _MAX_MODEL_LEN.reset(token)


def max_model_len_of(config) -> int:
    """The context length the model is being built for: the engine's ``--max-model-len`` inside
    :func:`model_build_context`, else ``config.max_position_embeddings``."""
    return _MAX_MODEL_LEN.get() or config.max_position_embeddings


def build_model(
    model_cls: type[nn.Module], config, device: torch.device, dtype: torch.dtype, max_model_len
) -> nn.Module:
    """``model_cls(config)`` in eval mode, its parameters created (unread) on ``device`` in
    ``dtype``, for a context of ``max_model_len`` tokens (see :func:`model_build_context`)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), model_build_context(max_model_len):
            return model_cls(config).eval()
    finally:
        torch.set_default_dtype(previous)
