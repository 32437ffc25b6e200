"""What rank 0 sends a TP worker down the control channel: one small dataclass per kind.

On the wire (:mod:`pyxllm.distributed.control`: compact JSON, nothing executable) a message is
a list whose first item names its kind: ``["step", sequences]`` (the plan's sequences as
:class:`~pyxllm.executor.plan_codec.PlanEncoder` encodes them) or ``["stop"]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyxllm.executor.plan_codec import EncodedSequence


@dataclass(frozen=True, slots=True)
class StepMessage:
    """Run one step: every scheduled sequence, delta-encoded against the previous step."""

    sequences: list[EncodedSequence]


@dataclass(frozen=True, slots=True)
class StopMessage:
    """Exit with status 0: rank 0 is shutting down."""


WorkerMessage = StepMessage | StopMessage


def to_wire(message: WorkerMessage) -> list:
    """``message`` as the JSON value the control channel sends."""
    if isinstance(message, StepMessage):
        return ["step", message.sequences]
    return ["stop"]


def from_wire(value: object) -> WorkerMessage:
    """The message a JSON value from the control channel holds.

    Raises:
        ValueError: not a message of a known kind.
    """
    match value:
        case ["step", list(sequences)]:
            return StepMessage(sequences)
        case ["stop"]:
            return StopMessage()
    raise ValueError(f"not a worker message: {str(value)[:100]}")
