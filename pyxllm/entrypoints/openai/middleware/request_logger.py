"""``--enable-log-requests``: a log line when a request arrives and one when it ends (vLLM's
``RequestLogger``), on the logger ``pyxllm.entrypoints.openai.middleware.request_logger``::

    request chatcmpl-1f…: 57 prompt tokens, SamplingParams(n=1, …), prompt: '<|im_start|>…'
    request chatcmpl-1f…: finished (stop), 12 output tokens, TTFT 0.081 s, e2e 0.412 s

The prompt is its text (a chat's rendered template, special tokens kept), cut at
``--max-log-len`` characters. Times count from the request's ``arrival_time`` (when the server
processed it). A request that ends before its last output (its client left, an error) gets an
``aborted`` line instead.
"""

from __future__ import annotations

import logging
import time

from pyxllm.engine.input_processor import EngineRequest
from pyxllm.engine.tokenizer import Tokenizer
from pyxllm.outputs import RequestOutput

logger = logging.getLogger(__name__)


class RequestLogger:
    """Writes the request lines of one server.

    Args:
        tokenizer: decodes a prompt given as token ids (a chat) for its line.
        max_log_len: the most characters of a prompt a line shows; ``None``: all of it.
    """

    def __init__(self, tokenizer: Tokenizer, max_log_len: int | None = None) -> None:
        self.tokenizer, self.max_log_len = tokenizer, max_log_len

    def log_inputs(self, request: EngineRequest) -> None:
        """The arrival line: id, prompt length, sampling parameters and prompt text."""
        text = request.prompt
        if text is None:
            ids = request.prompt_token_ids
            if self.max_log_len is not None:
                ids = ids[: self.max_log_len]  # a token has at least one character
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if self.max_log_len is not None:
            text = text[: self.max_log_len]
        logger.info(
            "request %s: %d prompt tokens, %s, prompt: %r",
            request.request_id,
            len(request.prompt_token_ids),
            request.sampling_params,
            text,
        )

    def watch(self, request: EngineRequest) -> RequestWatch:
        """A watch that writes ``request``'s closing line (see :class:`RequestWatch`)."""
        return RequestWatch(request)


class RequestWatch:
    """Follows one request's outputs: notes when its first token came, and writes its closing
    line once, at the last output (:meth:`observe`) or, when that never comes, at
    :meth:`close`."""

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.first_token_time: float | None = None
        self.output: RequestOutput | None = None
        self.done = False

    def observe(self, output: RequestOutput) -> None:
        """Take the request's latest output; the finished one writes the closing line."""
        if self.first_token_time is None and any(c.token_ids for c in output.outputs):
            self.first_token_time = time.monotonic()
        self.output = output
        if output.finished:
            self._log("finished")

    def close(self) -> None:
        """The request's response ended: write an ``aborted`` line if no finished output came."""
        self._log("aborted")

    def _log(self, how: str) -> None:
        if self.done:
            return
        self.done = True
        now, arrival = time.monotonic(), self.request.arrival_time
        outputs = self.output.outputs if self.output is not None else []
        reasons = ", ".join(c.finish_reason or "unfinished" for c in outputs) or "no output"
        ttft = "-" if self.first_token_time is None else f"{self.first_token_time - arrival:.3f} s"
        logger.info(
            "request %s: %s (%s), %d output tokens, TTFT %s, e2e %.3f s",
            self.request.request_id,
            how,
            reasons,
            sum(len(c.token_ids) for c in outputs),
            ttft,
            now - arrival,
        )
