"""What the engine drives: the :class:`Executor` protocol (:func:`pyxllm.executor.factory.
build_executor` picks the implementation).

The engine's scheduler is the same for one process and for several tensor-parallel ranks; only
the executor differs (vLLM's ``vllm/v1/executor/abstract.py``):

- :class:`~pyxllm.executor.uniproc.UniprocExecutor`: one process, one rank (``--tp 1``);
- :class:`~pyxllm.executor.multiproc.MultiprocExecutor`: rank 0 of several, driving the workers;
- :class:`~pyxllm.executor.ray_executor.RayDistributedExecutor`: the same, the workers placed as
  Ray actors (``--distributed-executor-backend ray``).

Both wrap rank 0's :class:`~pyxllm.executor.model_executor.ModelExecutor` (the model, its KV
cache, runner and sampler) as :attr:`Executor.driver`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from pyxllm.executor.model_executor import ModelExecutor, StepResult
    from pyxllm.executor.scheduler_output import SchedulerOutput


class Executor(Protocol):
    """Runs the scheduler's steps on every rank and returns rank 0's sampled tokens.

    Attributes:
        model_config: the model's Hugging Face config (``vocab_size``, ...).
        dtype: the compute dtype (``--dtype`` resolved for the platform and checkpoint).
        num_kv_blocks: KV blocks every rank holds (the smallest count any rank can afford).
        failure: ``None`` while the executor can run steps, else why it never can again (the
            message names the failed TP rank); the server exits when it is set.
        driver: rank 0's :class:`ModelExecutor`, for tools that run the model directly
            (``pyxllm check-device``, tests).
    """

    model_config: Any
    dtype: torch.dtype
    num_kv_blocks: int
    failure: str | None
    driver: ModelExecutor

    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Run one step of ``plan`` on every rank: rank 0's sampled tokens (and logprobs).

        Raises:
            WorkerDiedError: a TP worker died before or during the step.
        """
        ...

    def check_health(self) -> None:
        """Return when the executor can run steps.

        Raises:
            WorkerDiedError: a TP worker has died (naming its rank).
        """
        ...

    def shutdown(self) -> None:
        """Stop whatever the executor started (TP workers) and release the group; idempotent."""
        ...
