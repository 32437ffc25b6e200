"""The intra-op thread count of CPU steps, chosen by measuring steps rather than fixed.

Why: a step runs a few hundred OpenMP parallel regions, and each waits at its end for every
thread of the team. When another process keeps one of the cores busy, the thread that shares a
core with it is descheduled for a time slice now and then, and the whole team waits: with two
threads on two cores, a busy core cut batch-1 decode to ~30 % of the quiet rate (llama.cpp's
own to ~3 %), while one thread on the free core kept ~70 % (``benchmarks/busy_core.py``).
OpenMP's passive wait policy does not help (it halves the quiet rate). Which count is fastest
depends on what else runs, so the tuner measures it while serving: a
step's results do not depend on the thread count (the kernels split work by rows, heads or
output features, never a sum; tests/executor/test_thread_tuner.py), so only speed changes.

How: decode-only steps are timed per batch size (a LoRA engine's steps with adapters apart from
its base-only ones). Every ``interval`` such steps the tuner runs
``probe_steps`` steps at a neighbouring count (half or double the current one, within 1 ..
the configured threads, alternating) and moves there when their median time beats the current
count's recent median by ``margin``; a probe that confirms the current count doubles the
interval (up to ``max_interval``), so a steady machine pays for probing less and less (a probe
at the slower count costs its few steps). Prefill steps run at the current count untimed: their
length varies too much to compare. An encoder's steps (the pooling tasks, which are all
prefills) are timed by their token count rounded up to a power of two instead
(``PoolingExecutor``): on two busy cores one thread made small embed steps 3-7x faster.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

import torch

# ``0`` turns the tuner off: every step runs at the configured thread count
ENV = "PYXLLM_ADAPTIVE_THREADS"


class ThreadTuner:
    """Chooses the thread count of each step (see the module docstring).

    Args:
        max_threads: the configured count (``torch.get_num_threads()`` of the stepping
            thread); candidates are its halvings down to 1.
        probe_steps: steps a probe runs, and the recent steps it is compared with.
        interval, max_interval: decode steps between probes, first and at most.
        margin: how much faster (a fraction of the step time) a probed count must be to win.
        clock: seconds, monotonic (a parameter for tests).
    """

    def __init__(
        self,
        max_threads: int,
        probe_steps: int = 4,
        interval: int = 32,
        max_interval: int = 512,
        margin: float = 0.1,
        clock=time.perf_counter,
    ) -> None:
        counts, n = set(), max_threads
        while n >= 1:
            counts.add(n)
            n //= 2
        self.candidates = sorted(counts)  # the halvings end at 1
        self.current = max_threads
        self.probe_steps, self.base_interval, self.max_interval = (
            probe_steps,
            interval,
            max_interval,
        )
        self.margin, self.clock = margin, clock
        self.interval = self.countdown = interval
        self.probing: int | None = None
        self.probe_left = 0
        self._down = True  # the next probe's direction
        # (threads, key) -> the latest step times
        self.samples: dict[tuple[int, Hashable], deque] = defaultdict(
            lambda: deque(maxlen=probe_steps)
        )
        self.switches = 0

    def threads_for(self, key: Hashable | None) -> int:
        """The count to run the next step at; ``key``: what its time is compared under (its
        batch size if it decodes only; see ``model_executor.tuner_key``), else ``None`` (not
        timed, run at the current count)."""
        if key is None:
            return self.current
        if self.probing is None and self.countdown <= 0:
            self.probing = self._neighbour()
            self.probe_left = self.probe_steps
            if self.probing is None:  # a single candidate: nothing to try
                self.countdown = self.max_interval
        return self.probing or self.current

    def record(self, key: Hashable | None, threads: int, seconds: float) -> None:
        """A step of key ``key`` (``None``: not timed) took ``seconds`` at ``threads``."""
        if key is None:
            return
        self.samples[(threads, key)].append(seconds)
        if self.probing is None or threads != self.probing:
            self.countdown -= 1
            return
        self.probe_left -= 1
        if self.probe_left == 0:
            self._decide(key)

    @contextmanager
    def step(self, key: Hashable | None) -> Iterator[int]:
        """Run a step at :meth:`threads_for`'s count (set on the calling thread) and time it."""
        threads = self.threads_for(key)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        start = self.clock()
        yield threads
        self.record(key, threads, self.clock() - start)

    def _neighbour(self) -> int | None:
        i = self.candidates.index(self.current)
        down = self.candidates[i - 1] if i > 0 else None
        up = self.candidates[i + 1] if i + 1 < len(self.candidates) else None
        self._down = not self._down
        return (down if self._down else up) or down or up

    def _decide(self, key: Hashable) -> None:
        probe = self.samples[(self.probing, key)]
        reference = self.samples[(self.current, key)]
        if len(reference) >= max(1, self.probe_steps // 2):  # else: nothing to compare with
            if statistics.median(probe) < statistics.median(reference) * (1 - self.margin):
                self.current, self.interval = self.probing, self.base_interval
                self.switches += 1
            else:
                self.interval = min(2 * self.interval, self.max_interval)
        self.samples.pop((self.probing, key), None)  # a later probe measures afresh
        self.probing, self.countdown = None, self.interval


def make_thread_tuner(platform, tp_world_size: int) -> ThreadTuner | None:
    """A tuner for an engine of one rank with more than one thread on a platform whose steps
    run on host threads (``platform.adaptive_threads``: the CPU), unless
    ``$PYXLLM_ADAPTIVE_THREADS`` is ``0``; else ``None``. Under tensor parallelism every rank
    keeps its count (the ranks meet at each collective, so one rank's probe would time the
    others)."""
    if not platform.adaptive_threads or tp_world_size != 1 or os.environ.get(ENV, "1") == "0":
        return None
    threads = torch.get_num_threads()
    return ThreadTuner(threads) if threads > 1 else None


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the body on one torch thread, then restore the count: for start-up work that is
    mostly single-threaded Python, numpy or short OpenMP regions (loading and packing weights,
    graph captures). On threads that share their cores with another process such regions stall
    (see the module docstring); on a quiet machine they are a small part of that work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
