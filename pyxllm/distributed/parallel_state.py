"""Tensor-parallel state of this process: its TP rank, the TP world size and the collectives.

With one process (the default) every collective is the identity, so layers call them
unconditionally and hold no "if distributed" branch. With several, :func:`init_distributed`
joins this process to the others: every rank of the world is a TP rank, and the collectives run
on torch.distributed's default group with the platform's backend (gloo on CPU, nccl on CUDA,
hccl on NPU).

Start-up: rank 0 hosts a ``torch.distributed.TCPStore`` at the master address ``host:port``;
the other ranks connect to it, retrying until a deadline, so ranks may start in any order. Each
rank counts itself in the store; rank 0 waits until all have, then every rank calls
``init_process_group`` on that store. A rank that does not get there within ``timeout_s``
raises :class:`DistributedError` naming the address and the timeout. Across hosts, gloo picks
its network interface from the host name; set ``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME``,
``HCCL_SOCKET_IFNAME``) when that is the wrong one.

Logits are gathered to rank 0 (``torch.distributed.gather``, not an all-gather): only rank 0
samples, so the other ranks need not receive the vocabulary-wide rows.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pyxllm.distributed.address import parse_master_addr
from pyxllm.distributed.errors import DistributedError

__all__ = [
    "DistributedError",
    "destroy_distributed",
    "get_local_rank",
    "get_store",
    "get_tp_rank",
    "get_tp_size",
    "init_distributed",
    "parse_master_addr",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather",
    "tensor_model_parallel_min",
    "tp_state",
]

_JOINED_KEY = "pyxllm/joined"

# Waits, in seconds, within the --dist-init-timeout deadline:
# a worker's attempt to reach the master address lasts at most this long (at least the second),
# and it retries this often
CONNECT_ATTEMPT_MAX_S = 2.0
CONNECT_ATTEMPT_MIN_S = 0.1
CONNECT_RETRY_S = 0.2
# rank 0 counts the joined ranks this often
JOIN_POLL_S = 0.05
# a worker's store operations time out after what is left of the deadline, but never sooner
STORE_TIMEOUT_MIN_S = 1.0


@dataclass(slots=True)
class _TPState:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device | None = None
    store: object | None = None


_TP = _TPState()


def get_tp_rank() -> int:
    """This process's tensor-parallel rank, 0-based."""
    return _TP.rank


def get_tp_size() -> int:
    """Number of tensor-parallel ranks (1 without tensor parallelism)."""
    return _TP.world_size


def get_local_rank() -> int:
    """This rank's index among the ranks of its host (the card it takes)."""
    return _TP.local_rank


def get_store():
    """The ``TCPStore`` the ranks met through (``None`` on one process)."""
    return _TP.store


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP ranks in place and return it (identity on one rank)."""
    if _TP.world_size == 1:
        return x
    torch.distributed.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate ``x`` from every TP rank along ``dim`` (identity on one rank)."""
    if _TP.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_gather(
    x: torch.Tensor, dim: int = -1, dst: int = 0
) -> torch.Tensor | None:
    """Concatenate ``x`` from every TP rank along ``dim`` on rank ``dst``; ``None`` elsewhere.

    Every rank must call it with the same shape (identity on one rank).
    """
    if _TP.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)] if _TP.rank == dst else None
    torch.distributed.gather(x.contiguous(), parts, dst=dst)
    return None if parts is None else torch.cat(parts, dim=dim)


def tensor_model_parallel_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """``x`` as TP rank ``src`` holds it, on every rank: overwritten in place and returned
    (identity on one rank). Every rank passes a tensor of the same shape and dtype."""
    if _TP.world_size == 1:
        return x
    torch.distributed.broadcast(x, src=src)
    return x


def tensor_model_parallel_min(value: int) -> int:
    """The smallest of every rank's ``value`` (e.g. KV blocks, so all ranks allocate the same)."""
    if _TP.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=_TP.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())


@contextmanager
def tp_state(rank: int, world_size: int) -> Iterator[None]:
    """Pretend to be TP rank ``rank`` of ``world_size`` (no processes, no collectives) while
    building a model, e.g. on the meta device to check that it splits before spawning ranks."""
    global _TP
    saved, _TP = _TP, _TPState(rank=rank, world_size=world_size)
    try:
        yield
    finally:
        _TP = saved


def _wait_reachable(host: str, port: int, deadline: float) -> None:
    """Retry a TCP connection to ``host:port`` until it is accepted or ``deadline`` passes."""
    while True:
        try:
            with socket.create_connection(
                (host, port),
                timeout=max(
                    CONNECT_ATTEMPT_MIN_S, min(CONNECT_ATTEMPT_MAX_S, deadline - time.monotonic())
                ),
            ):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(CONNECT_RETRY_S)


def init_distributed(
    platform,
    rank: int,
    world_size: int,
    master_addr: str,
    timeout_s: float,
    local_rank: int = 0,
    check_alive: Callable[[], None] | None = None,
    join_hint: str | None = None,
):
    """Join the ``world_size`` ranks at ``master_addr`` and set this process's TP state.

    Args:
        platform: gives the backend (``platform.dist_backend``) and this rank's device.
        rank: 0 hosts the store and waits for the others; others connect to it.
        timeout_s: how long to wait for the master (rank > 0) or for every rank (rank 0).
        local_rank: this rank's index on its host (its card).
        check_alive: rank 0 calls it while waiting; it raises when a spawned rank has died.
        join_hint: what rank 0's time-out message advises (default: how to start the ranks by
            hand).
    Returns:
        The ``TCPStore``, also kept for :func:`get_store`.
    Raises:
        DistributedError: "rank i could not reach the master address host:port within N s", or
            rank 0 could not listen there, or not every rank joined in time.
    """
    host, port = parse_master_addr(master_addr)
    deadline = time.monotonic() + timeout_s
    where = f"{host}:{port}"
    if rank == 0:
        try:
            store = dist.TCPStore(
                host,
                port,
                world_size,
                is_master=True,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as e:
            raise DistributedError(
                f"rank 0 could not listen on the master address {where} ({e}); "
                "pick a free port on this host"
            ) from None
        while (joined := store.add(_JOINED_KEY, 0)) < world_size - 1:
            if check_alive is not None:
                check_alive()
            if time.monotonic() >= deadline:
                hint = join_hint or (
                    f"start them with --nnodes {world_size} --node-rank i --master-addr {where}"
                )
                raise DistributedError(
                    f"rank 0: only {joined} of {world_size - 1} other ranks joined at {where} "
                    f"within {timeout_s:g} s; {hint}"
                )
            time.sleep(JOIN_POLL_S)
    else:
        try:
            _wait_reachable(host, port, deadline)
            store = dist.TCPStore(
                host,
                port,
                world_size,
                is_master=False,
                timeout=timedelta(seconds=max(STORE_TIMEOUT_MIN_S, deadline - time.monotonic())),
            )
        except (RuntimeError, OSError):
            raise DistributedError(
                f"rank {rank} could not reach the master address {where} within {timeout_s:g} s; "
                "start rank 0 there, or check --master-addr and the network"
            ) from None
        store.add(_JOINED_KEY, 1)
    dist.init_process_group(platform.dist_backend, store=store, rank=rank, world_size=world_size)
    device = platform.device(platform.device_index(local_rank))
    _TP.rank, _TP.world_size, _TP.local_rank, _TP.device, _TP.store = (
        rank,
        world_size,
        local_rank,
        device,
        store,
    )
    return store


def destroy_distributed() -> None:
    """Leave the process group (if joined) and return to the one-process state."""
    global _TP
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _TP = _TPState()
