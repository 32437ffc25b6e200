"""Structured outputs in the engine: compiling constraints off the engine loop, caching them,
and each step's bitmask for the constrained rows (vLLM's ``StructuredOutputManager``).

- :meth:`StructuredOutputManager.submit` starts compiling a request's constraint on a small
  thread pool and returns a :class:`GrammarHandle` at once; the same spec (kind and text) is
  compiled once and shared (an LRU cache of :data:`GRAMMAR_CACHE_SIZE` specs). The HTTP server
  awaits the handle before the response starts (so a constraint that does not compile is a 400
  before any token), ``LLM`` waits for it before running anything; the engine loop never does.
- Each request gets its own matcher (:meth:`GrammarHandle.new_matcher`), which lives on the
  engine's ``Request``: it survives preemption (the output tokens it has consumed stay) and
  ``n > 1`` children have one each.
- :meth:`StructuredOutputManager.fill_bitmask` computes the step's ``int32 [rows, words]``
  bitmask for the matchers of the rows that sample (see :mod:`.backend` for the layout);
  :meth:`StructuredOutputManager.fill_draft_bitmask` the ``1 + k`` rows of a sequence that
  verifies ``k`` speculative drafts (vLLM's way: advance the matcher over the drafts, then roll
  it back).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from pyxllm.config import STRUCTURED_OUTPUTS_BACKENDS
from pyxllm.engine.errors import InvalidRequestError
from pyxllm.engine.structured_output.backend import (
    GrammarError,
    GrammarMatcher,
    StructuredOutputBackend,
    bitmask_width,
)
from pyxllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Threads compiling grammars (a compile drops the GIL in the library).
COMPILE_THREADS = 2
# Compiled specs kept for reuse.
GRAMMAR_CACHE_SIZE = 128
# Longest a request waits for its constraint to compile before it is refused (seconds); the
# libraries' own parser limits usually stop a pathological one first.
GRAMMAR_COMPILE_TIMEOUT_S = 10.0


def _build_backend(name: str, *args) -> StructuredOutputBackend:
    """The backend, warmed up: a library's first token mask also prepares its view of the
    vocabulary (2.7 s for llguidance on 49k tokens, 2 AVX2 cores; later masks take well under a
    millisecond), which no request should wait for."""
    if name == "llguidance":
        # lazy: only the chosen backend's library loads, on first use
        from pyxllm.engine.structured_output.llguidance_backend import LLGuidanceBackend as cls
    else:
        # lazy: xgrammar is optional, and loads only when chosen
        from pyxllm.engine.structured_output.xgrammar_backend import XGrammarBackend as cls
    backend = cls(*args)
    matcher = backend.new_matcher(backend.compile(StructuredOutputsParams(json_object=True)))
    vocab_size = args[1]
    backend.fill_bitmasks([matcher], torch.empty(1, bitmask_width(vocab_size), dtype=torch.int32))
    return backend


def spec_key(spec: StructuredOutputsParams) -> tuple[str, str, bool]:
    """The cache key of a spec: its kind, its canonical text (a JSON schema with sorted keys)
    and its whitespace option."""
    value, text = getattr(spec, spec.kind), None
    if spec.kind == "json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
            text = json.dumps(schema, sort_keys=True)
        except ValueError:  # not JSON: the backend will refuse it
            pass
    elif spec.kind == "choice":
        text = json.dumps(list(value))
    return spec.kind, str(value) if text is None else text, spec.disable_any_whitespace


@dataclass(frozen=True, slots=True)
class GrammarHandle:
    """A request's constraint, compiling or compiled.

    Attributes:
        spec: the constraint as the request gave it.
        future: resolves to the backend's compiled grammar, or to its ``GrammarError``.
        backend: the backend that compiles it (resolved with the compiled grammar).
    """

    spec: StructuredOutputsParams
    future: Future
    backend: Future

    def done(self) -> bool:
        """Whether compiling has finished (well or not)."""
        return self.future.done()

    def compiled(self, timeout: float | None = GRAMMAR_COMPILE_TIMEOUT_S) -> object:
        """The compiled grammar, waiting up to ``timeout`` seconds.

        Raises:
            InvalidRequestError: the constraint does not compile (the library's message, naming
                the request field), or took longer than ``timeout``.
        """
        try:
            return self.future.result(timeout)
        except FutureTimeout:
            raise self.timeout_error(timeout) from None
        except GrammarError as exc:
            raise self._refused(exc) from None

    async def wait(self, timeout: float = GRAMMAR_COMPILE_TIMEOUT_S) -> None:
        """Wait (without blocking the event loop) until the constraint is compiled.

        Raises:
            InvalidRequestError: see :meth:`compiled`.
        """
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.future)), timeout)
        except asyncio.TimeoutError:
            raise self.timeout_error(timeout) from None
        except GrammarError as exc:
            raise self._refused(exc) from None

    def _refused(self, exc: GrammarError) -> InvalidRequestError:
        return InvalidRequestError(f"{self.spec.source}: {exc}", self.spec.source)

    def timeout_error(self, timeout: float) -> InvalidRequestError:
        """The error of a constraint that took longer than ``timeout`` seconds to compile."""
        source = self.spec.source
        return InvalidRequestError(f"{source}: took longer than {timeout:g} s to compile", source)

    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the start of the compiled constraint (call once compiled)."""
        return self.backend.result().new_matcher(self.compiled(timeout=0))


class StructuredOutputManager:
    """Compiles constraints for one model and fills the constrained rows' bitmasks.

    Args:
        backend: ``llguidance`` or ``xgrammar`` (``--structured-outputs-backend``).
        hf_tokenizer: the model's ``transformers`` fast tokenizer.
        vocab_size: the model's vocabulary size (the logits' columns).
        eos_token_ids: the ids that end generation.

    The backend itself (the library's view of the vocabulary: ~3 s of CPU for a 49k vocabulary
    on 2 cores, see :func:`_build_backend`) is built on the pool when the first constraint
    arrives, or when :meth:`prepare` asks for it (the API server does at start-up). Offline
    users who never constrain a request never pay for it, and its 3 s do not compete with their
    first requests for the cores (vLLM builds its backend lazily too).
    """

    def __init__(self, backend: str, hf_tokenizer, vocab_size: int, eos_token_ids) -> None:
        if backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured outputs backend {backend!r} is unknown")
        self.backend_name, self.vocab_size = backend, vocab_size
        # an end-of-sequence id past the model's vocabulary (a config's stale eos_token_id) can
        # never be sampled: it has no bit in the mask
        eos_token_ids = sorted(i for i in eos_token_ids if 0 <= i < vocab_size)
        self._args = (hf_tokenizer, vocab_size, eos_token_ids)
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="pyxllm-grammar")
        self._lock = threading.Lock()
        self._backend: Future | None = None
        self._cache: OrderedDict[tuple[str, str, bool], Future] = OrderedDict()
        self._eos_row = torch.zeros(bitmask_width(vocab_size), dtype=torch.int32)
        for token_id in eos_token_ids:
            self._eos_row[token_id // 32] |= torch.tensor(1 << (token_id % 32)).to(torch.int32)

    def prepare(self) -> None:
        """Start building the backend in the background now (returns at once)."""
        self._get_backend()

    def _get_backend(self) -> Future:
        with self._lock:
            if self._backend is None:
                self._backend = self._pool.submit(_build_backend, self.backend_name, *self._args)
            return self._backend

    def submit(self, spec: StructuredOutputsParams) -> GrammarHandle:
        """Start compiling ``spec`` (or reuse its compiled grammar); returns at once."""
        backend, key = self._get_backend(), spec_key(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(lambda: backend.result().compile(spec))
                self._cache[key] = future
                if len(self._cache) > GRAMMAR_CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return GrammarHandle(spec, future, backend)

    def fill_bitmask(
        self, matchers: list[GrammarMatcher]
    ) -> tuple[torch.Tensor, dict[int, Exception]]:
        """The bitmask ``int32 [len(matchers), ceil(vocab_size / 32)]`` of the matchers' next
        allowed tokens (row ``i`` for ``matchers[i]``), and the exception of each matcher the
        library failed on, by row (logged; its row allows EOS alone, and the engine fails its
        request: the engine loop goes on).

        A complete constraint allows EOS alone (what follows it with ``ignore_eos``).
        """
        bitmask = torch.empty(len(matchers), bitmask_width(self.vocab_size), dtype=torch.int32)
        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        for i in set(range(len(matchers))) - set(live):
            bitmask[i] = self._eos_row
        failures: dict[int, Exception] = {}
        if not live:
            return bitmask, failures
        backend = self._get_backend().result()
        try:
            if len(live) == len(matchers):
                backend.fill_bitmasks(matchers, bitmask)
            else:
                part = torch.empty(len(live), bitmask.shape[1], dtype=torch.int32)
                backend.fill_bitmasks([matchers[i] for i in live], part)
                bitmask[live] = part
        except Exception:  # noqa: BLE001 - one request's grammar must not stop the engine
            logger.exception("filling a constrained step's bitmask failed; retrying row by row")
            for i in live:
                try:
                    matchers[i].fill_bitmask(bitmask, i)
                except Exception as exc:  # noqa: BLE001
                    bitmask[i] = self._eos_row
                    failures[i] = exc
        return bitmask, failures

    def eos_rows(self, num_rows: int) -> torch.Tensor:
        """``int32 [num_rows, ceil(vocab_size / 32)]`` bitmask rows that allow EOS alone."""
        return self._eos_row.repeat(num_rows, 1)

    def fill_draft_bitmask(self, matcher: GrammarMatcher, drafts: list[int]) -> torch.Tensor:
        """The bitmask ``int32 [1 + k, ceil(vocab_size / 32)]`` of a sequence verifying the
        ``k`` drafts ``drafts``: row ``j`` allows what may follow ``drafts[:j]``. The matcher
        is advanced over the drafts and rolled back, so it ends where it started.

        Rows after a draft the constraint refuses are EOS rows: the target never samples the
        refused draft (its row's mask forbids it), so those rows are never used. (The engine
        cuts drafts at the first refused token before scheduling them; this is defensive.)
        """
        bitmask = self.eos_rows(1 + len(drafts))
        allowed = matcher.validate_tokens(drafts)
        advanced = 0
        try:
            for j in range(allowed + 1):
                if matcher.is_terminated():
                    break
                matcher.fill_bitmask(bitmask, j)
                if j < allowed:
                    matcher.accept_token(drafts[j])
                    advanced += 1
        finally:
            matcher.rollback(advanced)
        return bitmask

    def shutdown(self) -> None:
        """Stop the compile threads (compiles in flight finish first)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
