"""``pyxllm chat`` against a real server: driven through a pseudo-terminal (pexpect) as a person
would type, each reply must equal the server's own greedy answer to the same conversation (the
reference, asked with the openai SDK), which shows that the conversation is kept, ``/reset``
clears it, and ``--system`` and the API key reach the server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import openai
import pexpect
import pytest

from pyxllm.cli.main import main
from tests.utils import RemoteServer, free_port

KEY = "sk-chat-cli-7c1d"
ENGINE = ["--max-model-len", "512", "--kv-cache-memory", "0.25", "--dtype", "float32"]
SAMPLING = {"temperature": 0, "max_tokens": 12}
SAMPLING_FLAGS = ["--temperature", "0", "--max-tokens", "12"]
CHAT = [sys.executable, "-m", "pyxllm", "chat"]
# the next prompt after a reply, maybe behind readline's terminal escapes
NEXT_PROMPT = r"\r\n(?:\x1b\[[0-9;?]*[A-Za-z])*> "
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def server():
    with RemoteServer([*ENGINE, "--api-key", KEY], env={"OMP_NUM_THREADS": "1"}) as remote:
        yield remote


def reference(server: RemoteServer, messages: list[dict[str, str]], **sampling) -> str:
    """The server's greedy reply to ``messages`` (``SAMPLING`` unless given), not streamed."""
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=messages, **{**SAMPLING, **sampling}
    )
    return reply.choices[0].message.content


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def spawn_chat(server: RemoteServer, *args: str) -> pexpect.spawn:
    """``pyxllm chat --base-url <server> *args`` on a pseudo-terminal, the key in
    ``$OPENAI_API_KEY``."""
    return pexpect.spawn(
        CHAT[0],
        [*CHAT[1:], "--base-url", server.base_url, *args],
        env={**os.environ, "OPENAI_API_KEY": KEY, "TERM": "dumb"},
        encoding="utf-8",
        timeout=60,
        dimensions=(24, 250),
        # Ctrl-C as a terminal gives it: a process started with SIGINT ignored keeps it
        # ignored (Python then installs no KeyboardInterrupt), and a test worker of the suite
        # was seen in that state
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def ask(child: pexpect.spawn, question: str) -> str:
    """Type ``question`` and return the reply shown before the next prompt."""
    child.sendline(question)
    child.expect(NEXT_PROMPT)
    shown = ANSI.sub("", child.before).replace("\r\n", "\n")
    echoed, _, reply = shown.partition("\n")
    assert echoed.endswith(question), shown
    return reply


def test_an_interactive_chat_keeps_the_conversation_until_reset(server):
    first, second = "What is the capital of France?", "What did I just ask you?"
    answer = reference(server, [user(first)])
    with_history = reference(
        server, [user(first), {"role": "assistant", "content": answer}, user(second)]
    )
    fresh = reference(server, [user(second)])
    assert with_history != fresh  # else this test could not tell a kept conversation

    child = spawn_chat(server, *SAMPLING_FLAGS)
    try:
        child.expect_exact("Ctrl-D quits")
        child.expect_exact("> ")
        assert ask(child, first) == answer
        assert ask(child, second) == with_history
        child.sendline("/reset")
        child.expect_exact("(conversation cleared)")
        child.expect_exact("> ")
        assert ask(child, second) == fresh
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_ctrl_c_stops_a_reply_and_drops_its_question(server):
    story, question = "Write a very long story about a dragon who learns to cook.", "Hi"
    child = spawn_chat(server, "--temperature", "0", "--max-tokens", "400")
    try:
        child.expect_exact("> ")
        child.sendline(story)
        child.expect_exact(story + "\r\n")
        child.expect(r"\w+ ")  # the reply has begun; 400 tokens take seconds more
        child.sendintr()
        child.expect_exact("(stopped; that question is dropped)")
        child.expect_exact("> ")
        reply = ask(child, question)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    # asked in a fresh conversation: the stopped question and its partial reply were dropped
    fresh = reference(server, [user(question)], max_tokens=400)
    assert reply == fresh
    assert "stream closed early; aborting" in server.output()


def run_chat(capsys, *args: str) -> tuple[int, str, str]:
    """``pyxllm chat *args`` in this process: ``(status, stdout, stderr)``."""
    capsys.readouterr()
    try:
        status = main(["chat", *args])
    except SystemExit as exc:  # a usage error
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


def test_quick_prints_one_reply_with_the_system_message(server, capsys):
    system, question = "Answer in French.", "What is the capital of France?"
    expected = reference(server, [{"role": "system", "content": system}, user(question)])
    assert expected != reference(server, [user(question)])  # the system message matters

    status, out, err = run_chat(
        capsys, "--base-url", server.base_url, "--api-key", KEY, "--system", system,
        "--quick", question, *SAMPLING_FLAGS,
    )  # fmt: skip
    assert status == 0, err
    assert out == expected + "\n"


def test_quick_names_paris_without_a_length_bound(server):
    """Issue 36's item 7: ``pyxllm chat --quick "What is the capital of France?"`` as a user
    types it, in its own process, with no ``--max-tokens``: the reply ends at the model's end of
    turn and names Paris. Greedy (``--temperature 0``; ``pyxllm chat`` has no seed flag): at the
    model card's sampling about 1 answer in 6 is French nonsense instead (and so is the greedy
    answer of the default int8 GGUF weights; the suite runs float32). The timeout is a hang
    guard (sampling at temperature 1.0 with no length bound once ran past 120 s), not a speed
    check."""
    question = "What is the capital of France?"
    done = subprocess.run(
        [*CHAT, "--base-url", server.base_url, "--quick", question, "--temperature", "0"],
        env={**os.environ, "OPENAI_API_KEY": KEY},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout, done.stdout


def test_errors_name_the_flag_to_change(server, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    base = ["--base-url", server.base_url, "--quick", "Hi", *SAMPLING_FLAGS]
    status, _, err = run_chat(capsys, *base, "--api-key", "sk-wrong")
    assert status == 1
    assert "error: --api-key: the server refused it (HTTP 401" in err and "sk-wrong" not in err
    status, _, err = run_chat(capsys, *base)  # no key at all: not "refused", but needed
    assert status == 1
    assert "error: --api-key: the server needs one (HTTP 401" in err
    assert err.rstrip().endswith("give --api-key or set OPENAI_API_KEY")

    status, _, err = run_chat(capsys, *base, "--api-key", KEY, "--model", "no-such-model")
    assert status == 1
    assert "error: --model no-such-model" in err and "404" in err

    url = f"http://127.0.0.1:{free_port()}/v1"
    status, _, err = run_chat(capsys, "--base-url", url, "--quick", "Hi")
    assert status == 1 and f"error: --base-url {url}: cannot reach the server" in err

    status, _, err = run_chat(capsys, *base, "--top-p", "0")
    assert status == 2 and "--top-p: must be in (0, 1]" in err
