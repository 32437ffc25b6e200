"""The executor of a one-process run (``--tensor-parallel-size 1``)."""

from __future__ import annotations

from pyxllm.config import EngineConfig
from pyxllm.executor.abstract import Executor
from pyxllm.executor.model_executor import ModelExecutor, StepResult
from pyxllm.executor.scheduler_output import SchedulerOutput
from pyxllm.platforms import Platform
from pyxllm.weights import ModelSource


class UniprocExecutor(Executor):
    """One rank in this process: :attr:`driver` runs every step (vLLM's ``UniProcExecutor``).

    It exists so that the engine drives one process and several TP ranks through one
    :class:`~pyxllm.executor.abstract.Executor`: with no worker to lose, :attr:`failure` stays
    ``None``, :meth:`check_health` always passes and :meth:`shutdown` has nothing to stop (the
    model is freed with the executor).

    Raises:
        ValueError: see :class:`ModelExecutor` (an unsupported architecture or runner, a bad
            checkpoint, a KV cache budget too small for one block).
    """

    def __init__(
        self, config: EngineConfig, model_config, source: ModelSource, platform: Platform
    ) -> None:
        self.driver = ModelExecutor(config, model_config, source, platform)
        self.model_config, self.dtype = model_config, self.driver.dtype
        self.num_kv_blocks = self.driver.num_kv_blocks
        self.failure: str | None = None

    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Run ``plan`` on this process's model."""
        return self.driver.execute(plan)

    def check_health(self) -> None:
        """Always healthy: there is no other process to lose."""

    def shutdown(self) -> None:
        """Nothing to stop: no process or group was started."""
