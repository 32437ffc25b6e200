"""The engine's view of a tokenizer: a thin wrapper over a transformers tokenizer."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

# Longest a chat template may render, seconds: a template is a program (a request-supplied one
# with nested loops could run for ever), and the rendering thread has other requests to serve.
CHAT_TEMPLATE_TIMEOUT_S = 2.0

# Decodes of at least this many ids go through the Rust tokenizer's batch call, which releases
# the GIL (its single-text ``decode`` holds it: ~0.3 s for a million ids, a stall for every
# other thread, the server's event loop included); shorter ones skip the batch call's overhead.
LONG_DECODE_TOKENS = 4096

# Names of ``transformers`` ``apply_chat_template`` arguments that would change what it returns.
_RESERVED_TEMPLATE_KWARGS = (
    "conversation",
    "messages",
    "self",
    "tokenize",
    "return_dict",
    "return_tensors",
    "return_assistant_tokens_mask",
    "padding",
    "truncation",
    "max_length",
    "tokenizer_kwargs",
)


class Tokenizer:
    """Wraps a transformers (preferably fast) tokenizer; the engine and server only use this.

    Args:
        hf_tokenizer: a ``transformers`` tokenizer (``PreTrainedTokenizerBase``), available as
            ``hf``.
        eos_token_ids: extra token ids that end generation (e.g. from ``generation_config.json``
            or the GGUF metadata); ``hf.eos_token_id`` is always included.

    Attributes:
        hf: the wrapped transformers tokenizer.
        eos_token_ids: the union of ``eos_token_ids`` and ``hf.eos_token_id`` (an int or a list).
        vocab_size: ``len(hf)``, the base vocabulary plus added tokens.

    Decoding never applies ``clean_up_tokenization_spaces``, so that a text decoded in pieces
    (streaming) is the same as the text decoded at once.
    """

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos = {int(i) for i in eos_token_ids}
        hf_eos = getattr(hf_tokenizer, "eos_token_id", None)
        if isinstance(hf_eos, int):
            eos.add(hf_eos)
        elif hf_eos is not None:
            eos.update(int(i) for i in hf_eos)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size: int = len(hf_tokenizer)
        self._backend = _plain_backend(hf_tokenizer)
        self._token_bytes: dict[int, bytes] = {}
        self._byte_decoder = _byte_decoder(hf_tokenizer)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size}, "
            f"eos_token_ids={sorted(self.eos_token_ids)})"
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds e.g. a BOS token if the model uses
        one."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``, without special tokens (``<|im_end|>`` …) if
        ``skip_special_tokens``.

        An incomplete UTF-8 sequence at either end comes out as U+FFFD, as in transformers.
        A long decode (``LONG_DECODE_TOKENS``) lets other threads run meanwhile.
        """
        if self._backend is not None:  # what the fast tokenizer's decode calls, ~2 µs sooner
            ids = token_ids if isinstance(token_ids, list) else list(token_ids)
            if ids and type(ids[0]) is not int:  # numpy or tensor scalars, as transformers takes
                ids = [int(t) for t in ids]
            if len(ids) >= LONG_DECODE_TOKENS:
                return self._backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            list(token_ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def decode_each(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's text decoded alone, special tokens kept (as logprobs show tokens); a
        token holding part of a UTF-8 character comes out as U+FFFD."""
        return self.hf.batch_decode(
            [[int(t)] for t in token_ids],
            skip_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for, as OpenAI's logprob ``bytes``: a token
        holding part of a UTF-8 character gives those bytes (its decoded text is U+FFFD), so the
        bytes of a text's tokens joined are its UTF-8.

        From the vocabulary string: byte-level BPE strings (GPT-2's byte-to-character table,
        the tokenizer's ``ByteLevel`` decoder), SentencePiece byte tokens ``<0xE4>`` and ``▁``
        for a space; an added or special token's own text.
        """
        cached = self._token_bytes.get(token_id)
        if cached is None:
            cached = self._token_bytes[token_id] = self._bytes_of(token_id)
        return cached

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self.hf.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""
        added = getattr(self.hf, "added_tokens_decoder", {})
        if token_id in added:
            return str(added[token_id]).encode()
        if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)
        byte_token = _BYTE_TOKEN.fullmatch(piece)
        if byte_token:
            return bytes([int(byte_token.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of ``ids`` (e.g. ``"ĠParis"`` for a byte-level BPE)."""
        return list(self.hf.convert_ids_to_tokens(list(ids)))

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Token ids of a chat rendered with the model's jinja chat template.

        The template is rendered to a string first, then encoded with ``add_special_tokens=False``
        (the template writes its own BOS/control tokens), as vLLM does.

        Args:
            messages: OpenAI-style messages, each a mapping with a string ``role`` and a ``content``
                (a string, a list of parts, or ``None`` for an assistant message with
                ``tool_calls``).
            add_generation_prompt: append the header that opens the assistant's turn.
            **template_kwargs: passed to the template (e.g. ``enable_thinking=False``,
                ``tools=[...]``).

        Raises:
            ValueError: the tokenizer has no chat template, ``messages`` is empty or malformed,
                a reserved argument (``tokenize`` …) is given, or the template fails to render.
        """
        if (
            getattr(self.hf, "chat_template", None) is None
            and "chat_template" not in template_kwargs
        ):
            raise ValueError(
                f"tokenizer {type(self.hf).__name__} has no chat template; "
                "send a plain completion prompt or provide a model with a chat template"
            )
        for name in _RESERVED_TEMPLATE_KWARGS:
            if name in template_kwargs:
                raise ValueError(f"apply_chat_template: argument {name!r} is not supported")
        _check_messages(messages)
        try:
            with _time_limit(CHAT_TEMPLATE_TIMEOUT_S):
                text = self.hf.apply_chat_template(
                    messages,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                    **template_kwargs,
                )
        except ValueError:
            raise
        except Exception as e:  # jinja2.TemplateError, TypeError from the template, ...
            raise ValueError(f"chat template failed to render: {type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise ValueError(f"chat template rendered {type(text).__name__}, expected a string")
        return self.encode(text, add_special_tokens=False)


class TemplateTimeoutError(ValueError):
    """A chat template ran past :data:`CHAT_TEMPLATE_TIMEOUT_S`."""


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`TemplateTimeoutError` inside the jinja template code this thread runs once
    ``seconds`` have passed.

    transformers renders templates in jinja's ``ImmutableSandboxedEnvironment`` (no attribute
    access to internals, no mutation of the inputs, ``range`` capped), which bounds what a
    template can reach but not how long it runs. Compiled jinja templates are Python code whose
    file name is ``<template>``; a trace function on this thread checks the clock at each of
    their lines (other frames are not traced) and raises there, which unwinds the render. A
    single huge string operation (``'x' * 10**9``) is one line and is not interrupted.
    """
    deadline = time.monotonic() + seconds

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTimeoutError(f"chat template: rendering took more than {seconds:g} s")
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


def _check_messages(messages: Any) -> None:
    """Raise ``ValueError`` unless ``messages`` is a non-empty list of well-formed chat messages."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: expected a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(
                f"messages[{i}]: expected an object with 'role' and 'content', got "
                f"{type(m).__name__}"
            )
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]: 'role' is missing or not a string")
        if "content" not in m and not m.get("tool_calls"):
            raise ValueError(f"messages[{i}]: 'content' is missing")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            raise ValueError(f"messages[{i}]: 'content' is null")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}]: 'content' must be a string or a list of parts")


def _plain_backend(hf_tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` under a fast transformers tokenizer whose decoding is the
    backend's own (no subclass changes it), else ``None``."""
    # lazy: transformers takes ~1 s to import; the engine's modules load without it
    from transformers import PreTrainedTokenizerFast

    decode = getattr(type(hf_tokenizer), "_decode", None)
    return hf_tokenizer.backend_tokenizer if decode is PreTrainedTokenizerFast._decode else None


# a SentencePiece byte-fallback token: one byte, written <0xHH>
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder(hf_tokenizer: Any) -> dict[str, int] | None:
    """GPT-2's character -> byte table when the tokenizer's strings are byte-level BPE (its
    decoder is ``ByteLevel``), else ``None``."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None or "ByteLevel" not in repr(backend.decoder):
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # transformers' own table

    return {char: byte for byte, char in bytes_to_unicode().items()}
