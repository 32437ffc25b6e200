"""The step plan as rank 0 sends it to the TP workers: small, and for decodes only what changed.

A worker needs, per scheduled sequence, what builds its ``InputBatch`` (tokens, position, block
table), whether it is sampled and at how many prompt positions logprobs are wanted (the LM
head's gather is a collective, so every rank computes logits for the same rows); it never
samples, so sampling parameters, generators, penalty history and logprob targets stay on rank 0.
Both ends keep the state of the previous
step's sequences, keyed by a small integer handle that rank 0 gives each request:

``StepMessage([(handle, token_ids, num_computed, sample, keep, new_blocks, num_prompt_logprobs,
num_draft_tokens), ...])`` (:mod:`~pyxllm.executor.messages`)

- ``num_computed`` is ``-1`` when it equals the last step's ``num_computed + len(token_ids)``
  (always, for a sequence that keeps running), else the value (a new or recomputed sequence);
- the block table is the last one's first ``keep`` entries followed by ``new_blocks``: a decode
  sends ``keep = len(table)`` and one block id when it crosses into a new block, else none (a
  table cut after rejected speculative drafts keeps its common prefix);
- ``num_draft_tokens``: speculative drafts at the end of ``token_ids``, whose positions get
  logits too (every rank computes the same logit rows);
- a sequence absent from a step is forgotten; if it comes back, it is sent in full.

Sent as JSON (``distributed.control``), a decode step costs each sequence about 30 bytes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pyxllm.executor.messages import StepMessage
from pyxllm.executor.scheduler_output import ScheduledSequence, SchedulerOutput

# (handle, token_ids, num_computed or -1, sample, keep, new_blocks, number of prompt logprob
# targets, number of draft tokens)
EncodedSequence = tuple[int, list[int], int, bool, int, list[int], int, int]


@dataclass(slots=True)
class _Known:
    handle: int
    block_table: list[int]
    next_computed: int


class PlanEncoder:
    """Rank 0's side: turns each ``SchedulerOutput`` into the message for the workers."""

    def __init__(self) -> None:
        self._known: dict[str, _Known] = {}
        self._handles = itertools.count()

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
            seqs.append(
                (
                    handle,
                    list(s.token_ids),
                    computed,
                    s.sample,
                    keep,
                    table[keep:],
                    num_targets,
                    s.num_draft_tokens,
                )
            )
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
            handle, token_ids, computed, sample, keep, new_blocks, num_targets, drafts = entry
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
                )
            )
            known[handle] = _Known(handle, table, computed + len(token_ids))
        self._known = known
        return SchedulerOutput(out)
