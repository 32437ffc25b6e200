"""``pyxllm chat``: a chat in the terminal with any OpenAI-compatible server, as ``vllm chat``.

Each line typed is a user message; the reply streams from ``POST /chat/completions`` as it is
generated, and the conversation (the ``--system`` message, every question and reply) is sent
again with each question, so the model sees it all. ``/reset`` starts the conversation over
(keeping ``--system``), Ctrl-D quits, Ctrl-C stops a reply (that question and its partial
reply are dropped) or clears the line being typed. ``--quick MESSAGE`` prints one reply and
exits. Only the reply's ``content`` is printed (not the ``reasoning_content`` of a server
started with ``--reasoning-parser``, nor tool calls). Sampling flags not given are left to the
server.

The client is the ``openai`` package, a dependency of pyxllm: vLLM lists it among its own
requirements for the same command (and its OpenAI server's types), a chat client cannot work
without it, and it is small and pure Python, so an install that has ``pyxllm`` has
``pyxllm chat``. Errors: a server that cannot be reached, a refused API key or a 404 for the
model stops the command with ``error: <message naming the flag>`` (status 1); in the
interactive chat an error answering one question is printed and the chat goes on.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

import openai

from pyxllm.entrypoints.chat_args import API_KEY_ENV

RESET = "/reset"
PROMPT = "> "


class ChatSession:
    """One conversation with one model of one server.

    Attributes:
        client: the ``openai.OpenAI`` client.
        model: the model name sent.
        system: the system message kept across :meth:`reset`, or ``None``.
        options: more request fields (``temperature``, ``top_p``, ``max_tokens``).
        messages: the conversation so far (OpenAI chat messages).
    """

    def __init__(
        self, client: openai.OpenAI, model: str, system: str | None = None, **options
    ) -> None:
        self.client, self.model, self.system, self.options = client, model, system, options
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        """Start over: only the system message, if any, is left."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def send(self, text: str, out: TextIO) -> str:
        """Ask ``text``: stream the reply into ``out`` as it comes and return it. The question
        and the reply join the conversation only when the reply is complete.

        Raises:
            openai.OpenAIError: the server could not be reached or refused the request.
            KeyboardInterrupt: Ctrl-C while the reply streamed (the request is closed, so the
                server stops generating it).
        """
        messages = [*self.messages, {"role": "user", "content": text}]
        stream = self.client.chat.completions.create(
            model=self.model, messages=messages, stream=True, **self.options
        )
        parts = []
        try:
            for chunk in stream:
                delta = chunk.choices[0].delta.content if chunk.choices else None
                if delta:
                    out.write(delta)
                    out.flush()
                    parts.append(delta)
        finally:
            stream.close()
        reply = "".join(parts)
        self.messages = [*messages, {"role": "assistant", "content": reply}]
        return reply


# the key sent when neither --api-key nor $OPENAI_API_KEY gives one (the SDK needs a value)
NO_KEY = "EMPTY"


def describe_error(exc: openai.OpenAIError, base_url: str, model: str | None, api_key: str) -> str:
    """A one-line message for an error of the server or the connection, naming the flag to
    change (``model``: the model asked for, ``None`` before one is known; ``api_key``: the key
    sent, :data:`NO_KEY` when none was given)."""
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__ or exc  # the connection's own error (Connection refused, ...)
        return f"--base-url {base_url}: cannot reach the server ({cause})"
    if isinstance(exc, openai.APIStatusError):
        body = exc.body
        message = body.get("message", exc.message) if isinstance(body, dict) else exc.message
        status = exc.status_code
        if status in (401, 403) and api_key == NO_KEY:
            return (
                f"--api-key: the server needs one (HTTP {status}: {message}); give --api-key or "
                f"set {API_KEY_ENV}"
            )
        if status in (401, 403):
            return f"--api-key: the server refused it (HTTP {status}: {message})"
        if status == 404:
            flags = (
                f"--model {model} or --base-url {base_url}" if model else f"--base-url {base_url}"
            )
            return f"{flags}: HTTP 404: {message}"
        return f"HTTP {status}: {message}"
    return str(exc)


def first_model(client: openai.OpenAI) -> str:
    """The first model the server lists (``GET /models``).

    Raises:
        openai.OpenAIError: the server could not be reached or refused.
        ValueError: it lists none.
    """
    models = client.models.list().data
    if not models:
        raise ValueError("the server lists no model; give --model")
    return models[0].id


def chat_loop(session: ChatSession, out: TextIO, read=input) -> int:
    """The interactive chat: read a line with ``read(PROMPT)``, answer it, until end of input
    (Ctrl-D); returns 0."""
    out.write(
        f"pyxllm chat with {session.model} at {session.client.base_url}; {RESET} starts over, "
        "Ctrl-D quits\n"
    )
    while True:
        try:
            text = read(PROMPT)
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:  # clears the line, as a shell does
            out.write("\n")
            continue
        if text.strip() == RESET:
            session.reset()
            out.write("(conversation cleared)\n")
            continue
        if not text.strip():
            continue
        try:
            session.send(text, out)
        except KeyboardInterrupt:
            out.write("\n(stopped; that question is dropped)\n")
        except openai.OpenAIError as exc:
            client = session.client
            problem = describe_error(exc, str(client.base_url), session.model, client.api_key)
            out.write(f"\nerror: {problem}\n")
        else:
            out.write("\n")
        out.flush()


def run_chat(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``pyxllm chat``: the interactive chat, or with ``args.quick`` one reply; returns the exit
    status (1 when the server cannot be reached or refuses, see the module docstring)."""
    out = out if out is not None else sys.stdout
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or NO_KEY
    client = openai.OpenAI(base_url=args.base_url, api_key=api_key)
    options = {
        name: getattr(args, name)
        for name in ("temperature", "top_p", "max_tokens")
        if getattr(args, name) is not None
    }
    model = args.model
    try:
        model = model or first_model(client)
        session = ChatSession(client, model, args.system, **options)
        if args.quick is None:
            if sys.stdin.isatty():
                try:
                    import readline  # noqa: F401 - gives input() line editing and history
                except ImportError:
                    pass
            return chat_loop(session, out)
        session.send(args.quick, out)
        out.write("\n")
        out.flush()
        return 0
    except openai.OpenAIError as exc:
        print(f"error: {describe_error(exc, args.base_url, model, api_key)}", file=sys.stderr)
        return 1
