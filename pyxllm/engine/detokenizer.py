"""Incremental detokenization: UTF-8 safe streaming text and stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from pyxllm.engine.tokenizer import Tokenizer

# Prompt tokens decoded with the first output tokens, so that their leading space is right.
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
# Held tokens after which the window restarts even though the text still ends in U+FFFD
# (a UTF-8 character spans at most 4 tokens; more means the model produced invalid bytes).
MAX_PENDING_TOKENS = 16
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, a few tokens at a time.

    Text is decoded from a short window of recent tokens (``prefix_offset:``) and compared
    with the window's already-read part (``prefix_offset:read_offset``), as vLLM does: each
    step costs O(window), never a decode of the whole output. While the window's text ends in
    U+FFFD (a UTF-8 character split across tokens) the tail is held back until it completes.

    Stop strings are matched on the accumulated output text, so across token boundaries; the
    visible ``output_text`` never contains a prefix of a stop string that might still complete.

    Args:
        tokenizer: the engine's tokenizer.
        prompt_token_ids: the prompt; its last few tokens seed the window.
        skip_special_tokens: drop special tokens (``<|im_end|>`` …) from the text.
        stop: stop strings (empty strings are ignored).
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        min_tokens: stop strings only match in text of tokens fed after this many (as vLLM;
            text that might start a stop string is still held back before that).

    Attributes:
        stop_reason: the stop string that matched, ``None`` until one does.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.min_tokens = min_tokens
        self._num_fed = 0

        n_seed = min(len(prompt_token_ids), INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
        # The window: only the prompt's tail plus the output tokens not yet read for good.
        self._token_ids: list[int] = [
            int(t) for t in prompt_token_ids[len(prompt_token_ids) - n_seed :]
        ]
        self._prefix_offset = 0
        self._read_offset = n_seed
        self._prefix_len = len(
            self._decode(self._token_ids)
        )  # chars of decode(window[prefix:read])
        self._pending_emitted = 0  # chars past _prefix_len already taken while the tail was held

        self._text = ""  # all decoded output text, including text held back for stop strings
        self._visible = 0  # len(output_text)
        self._finished = False
        self.stop_reason: str | None = None  # the matched stop string, once one matched

    @property
    def output_text(self) -> str:
        """The text that may be shown so far; it only ever grows (a delta is
        ``text[len(prev):]``)."""
        return self._text[: self._visible]

    @property
    def finished(self) -> bool:
        """True once a stop string matched or ``finish()`` was called."""
        return self._finished

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Feed the tokens generated this step (usually one).

        Returns:
            The matched stop string when one appears in the text (the request must then
            finish; ``output_text`` is final), else ``None``.

        Raises:
            RuntimeError: the detokenizer already finished.
        """
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.update() called after it finished")
        if not new_token_ids:
            return None
        self._num_fed += len(new_token_ids)
        self._token_ids.extend(int(t) for t in new_token_ids)
        delta = self._decode_new_text()
        if not delta:
            return None
        old_len = len(self._text)
        self._text += delta
        if self.stop:
            matched = self._find_stop(old_len) if self._num_fed > self.min_tokens else None
            if matched is not None:
                return matched
            self._visible = max(self._visible, len(self._text) - self._held_stop_prefix_len())
        else:
            self._visible = len(self._text)
        return None

    def finish(self) -> str:
        """End the request for another reason (EOS, length, abort) and return the final text.

        Text held back as a possible stop-string prefix is released (it is real output); an
        incomplete trailing UTF-8 sequence is dropped, never emitted as U+FFFD. Idempotent.
        """
        if not self._finished:
            self._finished = True
            self._visible = len(self._text)
        return self.output_text

    # -- internals ------------------------------------------------------------------------

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new_text(self) -> str:
        """New stable text since the last call, advancing the window; '' while it is held."""
        ids = self._token_ids
        text = self._decode(ids[self._prefix_offset :])
        start = self._prefix_len + self._pending_emitted
        if not text.endswith(_REPLACEMENT):
            # The window ends on a character boundary: take everything and slide the window.
            delta = text[start:]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            self._prefix_len = len(self._decode(ids[self._prefix_offset : self._read_offset]))
            self._pending_emitted = 0
            self._trim()
            return delta
        # The tail is an incomplete character (or invalid bytes): hold it, take what precedes it.
        stable = len(text.rstrip(_REPLACEMENT))
        delta = text[start:stable] if stable > start else ""
        self._pending_emitted += len(delta)
        if len(ids) - self._read_offset > MAX_PENDING_TOKENS:
            # Invalid bytes that never form a character: restart the window on the last few
            # tokens, treating everything but their trailing U+FFFD run as already taken.
            keep = 4
            self._token_ids = ids[len(ids) - keep :]
            self._prefix_offset = self._read_offset = 0
            self._prefix_len = 0
            self._pending_emitted = len(self._decode(self._token_ids).rstrip(_REPLACEMENT))
        return delta

    def _trim(self) -> None:
        """Drop token ids before the window so memory stays O(window)."""
        if self._prefix_offset > 64:
            del self._token_ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _find_stop(self, old_len: int) -> str | None:
        """Match stop strings that the text past ``old_len`` could have completed.

        The match that ends first wins (ties: the longest), which is what a char-by-char
        stream would have found, whatever the tokenization. On a match the text is cut and
        the detokenizer finishes.
        """
        # Text already shown never starts a match (shown text holds no pending stop prefix; a
        # stop string shown whole before min_tokens is not matched afterwards).
        search_from = max(0, old_len - self._max_stop_len + 1, self._visible)
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self.stop:
            idx = self._text.find(s, search_from)
            if idx >= 0:
                cand = (idx + len(s), -len(s), s)
                if best is None or cand < best:
                    best = cand
        if best is None:
            return None
        end, neg_len, s = best
        self._text = self._text[: end if self.include_stop_str_in_output else end + neg_len]
        self._visible = len(self._text)
        self._finished = True
        self.stop_reason = s
        return s

    def _held_stop_prefix_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self._text
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held
