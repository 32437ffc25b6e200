"""Pooling a step's hidden states into one vector per sequence (an embedding model's head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

POOLING_TYPES = ("MEAN", "CLS", "LAST")


class Pooler(nn.Module):
    """One vector per sequence from its tokens' hidden states.

    Args:
        pooling_type: ``"MEAN"``: the mean over the sequence's tokens (sentence-transformers'
            mean pooling with every token unmasked); ``"CLS"``: its first token; ``"LAST"``:
            its last token (decoder embedding models such as Qwen3-Embedding).
        normalize: L2-normalize each vector (per request, :meth:`finish` may override it).

    Raises:
        ValueError: an unknown ``pooling_type``.
    """

    def __init__(self, pooling_type: str, normalize: bool) -> None:
        super().__init__()
        if pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling type {pooling_type!r} is not supported; supported: "
                f"{', '.join(POOLING_TYPES)}"
            )
        self.pooling_type, self.normalize = pooling_type, normalize

    def forward(self, hidden_states: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        """``hidden_states [T, hidden]`` of whole sequences laid end to end, ``query_lens``
        their lengths (summing to ``T``) -> ``float32 [len(query_lens), hidden]``, pooled but
        not normalized (see :meth:`finish`)."""
        hidden = hidden_states.float()
        ends = torch.tensor(query_lens, device=hidden.device).cumsum(0)
        if self.pooling_type == "CLS":
            return hidden[ends - ends.new_tensor(query_lens)]
        if self.pooling_type == "LAST":
            return hidden[ends - 1]
        return torch.stack([part.mean(0) for part in hidden.split(query_lens)])

    def finish(
        self, vector: torch.Tensor, dimensions: int | None, normalize: bool | None
    ) -> torch.Tensor:
        """One pooled ``float32 [hidden]`` vector as a request asks for it: its first
        ``dimensions`` values (all when ``None``), then L2-normalized when ``normalize`` (``None``:
        the model's :attr:`normalize`)."""
        if dimensions is not None:
            vector = vector[:dimensions]
        if self.normalize if normalize is None else normalize:
            vector = F.normalize(vector, p=2, dim=-1)
        return vector


# what a classifier's logits become: vLLM's activations (its PoolerIdentity, PoolerClassify)
ACTIVATIONS = ("identity", "sigmoid", "softmax")
# sentence-transformers' activation classes -> ours (vLLM loads only torch.nn.modules' too)
_ST_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Sigmoid": "classify",
    "torch.nn.modules.activation.Softmax": "classify",
}


def classifier_activation(config, task: str) -> str:
    """The activation of a sequence classifier's logits for engine task ``task``, as vLLM picks
    it: for ``score`` (a cross-encoder), sentence-transformers' ``activation_fn`` (or
    ``sbert_ce_default_activation_function``) in ``config``, else as for ``classify``; for
    ``classify``, ``identity`` for ``problem_type`` regression, ``sigmoid`` for multi-label,
    else ``sigmoid`` for one label (a cross-encoder's score, as sentence-transformers'
    CrossEncoder gives it) and ``softmax`` for several.

    Raises:
        ValueError: an activation class of sentence-transformers' this does not compute.
    """
    num_labels = getattr(config, "num_labels", 1)
    classify = "sigmoid" if num_labels < 2 else "softmax"
    if task == "score":
        st_config = getattr(config, "sentence_transformers", None)
        name = st_config.get("activation_fn") if isinstance(st_config, dict) else None
        name = name or getattr(config, "sbert_ce_default_activation_function", None)
        if name is not None:
            if name not in _ST_ACTIVATIONS:
                raise ValueError(
                    f"config.json: activation {name!r} is not supported; supported: "
                    f"{', '.join(_ST_ACTIVATIONS)}"
                )
            return classify if _ST_ACTIVATIONS[name] == "classify" else _ST_ACTIVATIONS[name]
    problem = getattr(config, "problem_type", None)
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    return classify


class ClassifierPooler(Pooler):
    """A sequence classifier's head (vLLM's ``ClassifierPooler``): each sequence's first
    ([CLS]) hidden state through ``classify`` (the model's ``[N, hidden] -> [N, num_labels]``
    head, in the model's dtype), then ``activation`` (one of :data:`ACTIVATIONS`) over the
    ``float32`` logits; never normalized.

    Raises:
        ValueError: an unknown ``activation``.
    """

    def __init__(self, classify, activation: str) -> None:
        super().__init__("CLS", False)
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"activation {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
            )
        self.classify, self.activation = classify, activation

    def forward(self, hidden_states: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        """``hidden_states [T, hidden]`` of whole sequences laid end to end -> ``float32
        [len(query_lens), num_labels]``, activated."""
        lens = torch.tensor(query_lens, device=hidden_states.device)
        logits = self.classify(hidden_states[lens.cumsum(0) - lens]).float()
        if self.activation == "sigmoid":
            return torch.sigmoid(logits)
        if self.activation == "softmax":
            return torch.softmax(logits, dim=-1)
        return logits
