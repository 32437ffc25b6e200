"""The step plan as rank 0 sends it to the TP workers: small, and for decodes only what changed.

A worker needs, per scheduled sequence, what builds its ``InputBatch`` (tokens, position, block
table), whether it is sampled and at how many prompt positions logprobs are wanted (the LM
head's gather is a collective, so every rank computes logits for the same rows); it never
samples, so sampling parameters, generators, penalty history and logprob targets stay on rank 0.
Both ends keep the state of the previous
step's sequences, keyed by a small integer handle that rank 0 gives each request:

``StepMessage([(handle, token_ids, num_computed, sample, keep, new_blocks, num_prompt_logprobs,
num_draft_tokens, images[, mrope_positions, bidirectional_ranges]), ...])``
(:mod:`~pyxllm.executor.messages`)

- ``num_computed`` is ``-1`` when it equals the last step's ``num_computed + len(token_ids)``
  (always, for a sequence that keeps running), else the value (a new or recomputed sequence);
- the block table is the last one's first ``keep`` entries followed by ``new_blocks``: a decode
  sends ``keep = len(table)`` and one block id when it crosses into a new block, else none (a
  table cut after rejected speculative drafts keeps its common prefix);
- ``num_draft_tokens``: speculative drafts at the end of ``token_ids``, whose positions get
  logits too (every rank computes the same logit rows);
- a sequence absent from a step is forgotten; if it comes back, it is sent in full;
- ``images``: a vision-language model's images whose placeholder runs the step's tokens overlap,
  ``[identifier, modality, offset, length, data]``, ``data`` the encoder's inputs (each tensor
  as dtype, shape and base64 bytes) only when rank 0's encoder cache lacks the image: every
  rank's cache sees the same steps, so it holds what rank 0's holds (see ``encoder_cache.py``);
- ``mrope_positions``: an mRoPE model's ``[3, len(token_ids)]`` positions as three lists
  (``null`` for 1-D positions), and ``bidirectional_ranges``: the ``[start, end)`` pairs of
  the images the step's tokens attend bidirectionally (Gemma 3's); both absent when neither is
  there (so a text model's decode costs no more).

Sent as JSON (``distributed.control``), a decode step costs each sequence about 30 bytes.
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Container
from dataclasses import dataclass

import torch

from pyxllm.executor.messages import StepMessage
from pyxllm.executor.scheduler_output import ScheduledSequence, SchedulerOutput
from pyxllm.multimodal_inputs import MultiModalFeatureSpec, PlaceholderRange

# (handle, token_ids, num_computed or -1, sample, keep, new_blocks, number of prompt logprob
# targets, number of draft tokens, images[, mRoPE positions])
EncodedSequence = tuple  # the fields above, the last one only where the sequence has them
# the dtypes an image's encoder inputs may have on the wire
_WIRE_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)
}


def tensor_to_wire(tensor: torch.Tensor) -> list:
    """``[dtype name, shape, base64 of its bytes]``: a CPU tensor in JSON.

    Raises:
        ValueError: a dtype outside :data:`_WIRE_DTYPES`.
    """
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _WIRE_DTYPES:
        raise ValueError(f"cannot send a {name} tensor to the TP workers")
    data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return [name, list(tensor.shape), base64.b64encode(data).decode("ascii")]


def tensor_from_wire(value: list) -> torch.Tensor:
    """The tensor :func:`tensor_to_wire` wrote.

    Raises:
        ValueError: an unknown dtype, or bytes that do not fill the shape.
    """
    name, shape, data = value
    if name not in _WIRE_DTYPES:
        raise ValueError(f"not a tensor dtype of the step plan: {name!r}")
    raw = torch.frombuffer(bytearray(base64.b64decode(data)), dtype=torch.uint8)
    return raw.view(_WIRE_DTYPES[name]).reshape(shape)


def _images_to_wire(features: list[MultiModalFeatureSpec], cached: Container[str]) -> list[list]:
    return [
        [
            f.identifier,
            f.modality,
            f.mm_position.offset,
            f.mm_position.length,
            None
            if f.identifier in cached
            else {key: tensor_to_wire(value) for key, value in f.data.items()},
        ]
        for f in features
    ]


def _images_from_wire(images: list[list]) -> list[MultiModalFeatureSpec]:
    return [
        MultiModalFeatureSpec(
            modality=modality,
            identifier=identifier,
            mm_position=PlaceholderRange(offset, length),
            data={key: tensor_from_wire(v) for key, v in (data or {}).items()},
        )
        for identifier, modality, offset, length, data in images
    ]


@dataclass(slots=True)
class _Known:
    handle: int
    block_table: list[int]
    next_computed: int


class PlanEncoder:
    """Rank 0's side: turns each ``SchedulerOutput`` into the message for the workers.

    Args:
        encoder_cache: rank 0's encoder cache (its ``entries`` keyed by image hash), whose
            images are sent without their data; ``None`` for a model without images.
    """

    def __init__(self, encoder_cache=None) -> None:
        self._known: dict[str, _Known] = {}
        self._handles = itertools.count()
        self._encoder_cache = encoder_cache

    def encode(self, plan: SchedulerOutput) -> StepMessage:
        """The message of ``plan`` for the workers (see the module docstring)."""
        known, seqs = {}, []
        for s in plan.sequences:
            prev = self._known.get(s.request_id)
            handle = next(self._handles) if prev is None else prev.handle
            table = s.block_table
            keep = 0
            if prev is not None:  # the common prefix of the last table and this one
                old = prev.block_table
                keep = next(
                    (j for j, (a, b) in enumerate(zip(old, table)) if a != b),
                    min(len(old), len(table)),
                )
            computed = (
                -1
                if prev is not None and prev.next_computed == s.num_computed_tokens
                else s.num_computed_tokens
            )
            num_targets = len(s.prompt_logprob_targets or ())
            entry = (
                handle,
                list(s.token_ids),
                computed,
                s.sample,
                keep,
                table[keep:],
                num_targets,
                s.num_draft_tokens,
                _images_to_wire(s.mm_features, self._encoder_cache.entries)
                if s.mm_features
                else [],
            )
            if s.mrope_positions is not None or s.bidirectional_ranges:
                mrope = s.mrope_positions
                entry += (
                    None if mrope is None else mrope.tolist(),
                    [list(r) for r in s.bidirectional_ranges],
                )
            seqs.append(entry)
            known[s.request_id] = _Known(
                handle, list(table), s.num_computed_tokens + len(s.token_ids)
            )
        self._known = known
        return StepMessage(seqs)


class PlanDecoder:
    """A worker's side: rebuilds the ``SchedulerOutput`` from a :class:`StepMessage` and the last
    step.

    Request ids become ``str(handle)``; ``sampling_params`` is ``None`` (workers do not sample)
    and ``prompt_logprob_targets`` holds placeholders (only its length matters there).

    Raises:
        ValueError: a message that refers to a sequence or block-table prefix it never got.
    """

    def __init__(self) -> None:
        self._known: dict[int, _Known] = {}

    def decode(self, message: StepMessage) -> SchedulerOutput:
        """The plan ``message`` encodes (see the class docstring)."""
        known, out = {}, []
        for entry in message.sequences:
            (
                handle,
                token_ids,
                computed,
                sample,
                keep,
                new_blocks,
                num_targets,
                drafts,
                images,
                *extra,
            ) = entry
            mrope, ranges = extra if extra else (None, ())
            prev = self._known.get(handle)
            if prev is None and (computed < 0 or keep):
                raise ValueError(
                    f"plan refers to sequence {handle}, which the last step did not have"
                )
            if computed < 0:
                computed = prev.next_computed
            table = (prev.block_table[:keep] if keep else []) + list(new_blocks)
            out.append(
                ScheduledSequence(
                    request_id=str(handle),
                    token_ids=token_ids,
                    num_computed_tokens=computed,
                    block_table=table,
                    sample=sample,
                    sampling_params=None,
                    prompt_logprob_targets=[0] * num_targets or None,
                    num_draft_tokens=drafts,
                    mm_features=_images_from_wire(images),
                    mrope_positions=None
                    if mrope is None
                    else torch.tensor(mrope, dtype=torch.long),
                    bidirectional_ranges=tuple((lo, hi) for lo, hi in ranges),
                )
            )
            known[handle] = _Known(handle, table, computed + len(token_ids))
        self._known = known
        return SchedulerOutput(out)
