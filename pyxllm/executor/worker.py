"""A tensor-parallel worker rank: join the ranks, load this rank's shard, run what rank 0 sends.

Runs in a process spawned by rank 0 (``--tensor-parallel-size N``), in a Ray actor
(``--distributed-executor-backend ray``, see :mod:`pyxllm.executor.ray_executor`), or started by
hand on its node (``pyxllm serve --nnodes N --node-rank i --master-addr host:port`` with
``i > 0``): no HTTP server, no tokenizer, no scheduler. The loop: receive a plan from the
control channel, decode it (:class:`~pyxllm.executor.plan_codec.PlanDecoder`), execute it (the
forward's collectives pair with the other ranks'; this rank never samples), repeat. It ends on
rank 0's stop message (status 0), or when rank 0's connection closes (rank 0 died: status 1). A
failure is reported to rank 0 before the worker exits, so rank 0 can name it. A spawned worker
ignores SIGINT: a Ctrl-C in the terminal reaches every process of the group, and rank 0 stops
the workers itself.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys

import torch

from pyxllm.config import EngineConfig
from pyxllm.distributed.control import ControlClient
from pyxllm.distributed.errors import DistributedError
from pyxllm.distributed.parallel_state import (
    destroy_distributed,
    get_store,
    init_distributed,
    parse_master_addr,
)
from pyxllm.executor.messages import StopMessage, from_wire
from pyxllm.executor.model_executor import ModelExecutor
from pyxllm.executor.plan_codec import PlanDecoder
from pyxllm.platforms import resolve_platform, set_current_platform
from pyxllm.weights import load_model_config, resolve_model_source

logger = logging.getLogger("pyxllm.worker")


def run_worker(
    config: EngineConfig,
    rank: int,
    world_size: int,
    master_addr: str,
    local_rank: int = 0,
    local_world_size: int = 1,
    num_threads: int | None = None,
) -> int:
    """Be TP rank ``rank`` (> 0) of ``world_size`` until rank 0 stops it; returns the exit status.

    It computes with ``num_threads`` torch threads, by default its share of this host's cores
    (``local_world_size`` ranks run here).

    Raises:
        DistributedError: the master address was not reachable within ``--dist-init-timeout``.
        ValueError: the model cannot be loaded (also reported to rank 0).
    """
    platform = set_current_platform(resolve_platform(config.device))
    init_distributed(platform, rank, world_size, master_addr, config.dist_init_timeout, local_rank)
    channel = None
    try:
        torch.set_num_threads(num_threads or platform.threads_per_rank(local_world_size))
        channel = ControlClient(
            parse_master_addr(master_addr)[0], get_store(), rank, config.dist_init_timeout
        )
        source = resolve_model_source(
            config.model, config.revision, config.download_dir, config.gguf_file
        )
        executor = ModelExecutor(config, load_model_config(source), source, platform)
        logger.info("rank %d of %d ready (%d KV blocks)", rank, world_size, executor.num_kv_blocks)
        decoder = PlanDecoder()
        while True:
            message = channel.recv()
            if message is None:
                logger.error(
                    "rank %d: rank 0 closed the control connection (it exited or died); exiting",
                    rank,
                )
                return 1
            message = from_wire(message)
            if isinstance(message, StopMessage):
                return 0
            try:
                executor.execute(decoder.decode(message))
            except RuntimeError as e:  # a collective broke: a peer (rank 0, or another worker) died
                raise DistributedError(
                    f"rank {rank}: a step's collective failed, another rank has probably "
                    f"died ({str(e).splitlines()[0][:300]})"
                ) from e
    except BaseException as e:
        if channel is not None:
            channel.report_error(f"{type(e).__name__}: {e}")
        raise
    finally:
        if channel is not None:
            channel.close()
        destroy_distributed()


def worker_main(
    config: EngineConfig,
    rank: int,
    world_size: int,
    master_addr: str,
    local_rank: int,
    local_world_size: int,
    spawned: bool = False,
) -> None:
    """Process entry point of a spawned worker: :func:`run_worker`, errors as one line, exit
    status."""
    if spawned:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING, format=f"%(levelname)s rank {rank} %(name)s: %(message)s"
    )
    try:
        code = run_worker(config, rank, world_size, master_addr, local_rank, local_world_size)
    except Exception as e:  # noqa: BLE001 - one line, not a traceback; rank 0 names it too
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        code = 1
    atexit._run_exitfuncs()  # multiprocessing's finalizers (semaphores) and other exit hooks, then
    sys.stdout.flush()  # skip the interpreter's slow teardown of torch: nothing is left to save
    sys.stderr.flush()
    os._exit(code)
