"""Scoring, shared by ``/v1/score``, ``/v1/rerank`` and ``LLM.score``: which texts pair up, and
each pair's score: with an embedding model the cosine similarity of its two embeddings, with a
cross-encoder its output for the pair (what vLLM computes with each)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyxllm.engine.errors import InvalidRequestError

# Most pairs one request may score (the most inputs one embeddings request may embed)
MAX_SCORE_PAIRS = 2048


def score_pairs(
    text_1: str | list[str], text_2: str | list[str], names: tuple[str, str] = ("text_1", "text_2")
) -> list[tuple[str, str]]:
    """The ``(text_1, text_2)`` pairs to score: one text against each of several (1 to N,
    either side), or two lists of one length pairwise; ``names`` are the fields of the two
    sides, for errors (a rerank's ``query`` and ``documents``).

    Raises:
        InvalidRequestError: naming the field: an empty list or text, lists of different
            lengths, or more than :data:`MAX_SCORE_PAIRS` pairs.
    """
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in zip(names, (left, right)):
        if not texts or "" in texts:
            raise InvalidRequestError(f"{name}: must not be empty", name)
    if len(left) == 1:
        left = left * len(right)
    elif len(right) == 1:
        right = right * len(left)
    elif len(left) != len(right):
        raise InvalidRequestError(
            f"{names[1]}: {len(right)} texts for {len(left)} in {names[0]}; give one text on a "
            "side, or lists of one length",
            names[1],
        )
    if len(left) > MAX_SCORE_PAIRS:
        raise InvalidRequestError(
            f"{names[1]}: at most {MAX_SCORE_PAIRS} pairs per request, got {len(left)}", names[1]
        )
    return list(zip(left, right))


def distinct_texts(pairs: list[tuple[str, str]]) -> list[str]:
    """Every text of ``pairs`` once, in first-seen order (each is embedded once)."""
    return list(dict.fromkeys(text for pair in pairs for text in pair))


def cosine_scores(pairs: list[tuple[str, str]], vectors: dict[str, torch.Tensor]) -> list[float]:
    """Each pair's cosine similarity, in [-1, 1], from its texts' ``vectors`` (``float32
    [dimensions]`` each)."""
    left = torch.stack([vectors[a] for a, _ in pairs])
    right = torch.stack([vectors[b] for _, b in pairs])
    return F.cosine_similarity(left, right, dim=-1).tolist()


def check_cross_encoder(class_labels: tuple[str, ...] | None, route: str) -> None:
    """Check that a classifier scores pairs: a cross-encoder has one label (its output is the
    score).

    Raises:
        InvalidRequestError: naming ``model`` and ``route``, for a classifier of several
            labels (``/classify`` serves it).
    """
    if class_labels is not None and len(class_labels) != 1:
        raise InvalidRequestError(
            f"{route}: this model classifies into {len(class_labels)} labels; scores need a "
            "cross-encoder (one label); use /classify",
            "model",
        )
