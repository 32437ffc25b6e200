"""Which :class:`~pyxllm.executor.abstract.Executor` the engine gets, apart from the protocol
that the implementations import (so no module imports one that imports it back)."""

from __future__ import annotations

from pyxllm.config import EngineConfig
from pyxllm.executor.abstract import Executor
from pyxllm.executor.multiproc import MultiprocExecutor
from pyxllm.executor.pooling_executor import PoolingExecutor
from pyxllm.executor.ray_executor import RayDistributedExecutor
from pyxllm.executor.uniproc import UniprocExecutor
from pyxllm.models.registry import check_task, is_encoder
from pyxllm.platforms import Platform
from pyxllm.pooling_params import POOLING_TASKS
from pyxllm.weights import ModelSource


def build_executor(
    config: EngineConfig, model_config, source: ModelSource, platform: Platform
) -> Executor:
    """For a pooling task (``--task embed``, ``score``, ``classify``) on an encoder a
    :class:`~pyxllm.executor.pooling_executor.PoolingExecutor`; else (a decoder embedding
    model too, pooled by the ``ModelExecutor``) a
    :class:`~pyxllm.executor.uniproc.UniprocExecutor` for one rank, else rank 0's
    :class:`~pyxllm.executor.multiproc.MultiprocExecutor` (``config.world_size`` > 1), or its
    :class:`~pyxllm.executor.ray_executor.RayDistributedExecutor` with
    ``--distributed-executor-backend ray``.

    Raises:
        ValueError: a model that does not run ``config.task`` (an encoder for generation);
            see the executors (an unsupported model, a model that does not split, ...).
        DistributedError: a rank did not join within ``--dist-init-timeout`` (with Ray: or the
            placement group was not placed, naming the missing resources).
    """
    check_task(model_config, config.task)
    if config.task in POOLING_TASKS and is_encoder(model_config):
        return PoolingExecutor(config, model_config, source, platform)
    if config.world_size == 1:
        return UniprocExecutor(config, model_config, source, platform)
    if config.distributed_executor_backend == "ray":
        return RayDistributedExecutor(config, model_config, source, platform)
    return MultiprocExecutor(config, model_config, source, platform)
