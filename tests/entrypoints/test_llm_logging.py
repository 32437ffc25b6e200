"""``LLM(...)`` in a script prints pyxllm's loading lines as ``pyxllm serve`` does (vLLM's
``LLM`` does too), unless logging is configured already or ``PYXLLM_CONFIGURE_LOGGING=0``."""

from __future__ import annotations

import logging

from pyxllm import LLM
from pyxllm.entrypoints.log_setup import ensure_logging
from tests.model_fixtures import build_checkpoint


def fresh_logging(monkeypatch) -> logging.Logger:
    """The root and ``pyxllm`` loggers with no handlers (pytest's own, added as the test
    starts, included); restored afterwards."""
    root, ours = logging.getLogger(), logging.getLogger("pyxllm")
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", ours.level)
    return ours


def test_a_configured_program_or_the_opt_out_keeps_its_own(monkeypatch):
    ours = fresh_logging(monkeypatch)
    monkeypatch.setenv("PYXLLM_CONFIGURE_LOGGING", "0")
    ensure_logging()
    assert ours.handlers == []
    monkeypatch.delenv("PYXLLM_CONFIGURE_LOGGING")
    logging.getLogger().handlers.append(logging.NullHandler())
    ensure_logging()
    assert ours.handlers == []


def test_llm_prints_its_loading_lines(tmp_path, hf_gguf_tokenizer, monkeypatch, capsys):
    directory, _ = build_checkpoint("llama", tmp_path / "llama", hf_gguf_tokenizer)
    monkeypatch.delenv("PYXLLM_CONFIGURE_LOGGING", raising=False)
    ours = fresh_logging(monkeypatch)
    LLM(str(directory), graph_backend="eager", kv_cache_memory=0.05)
    assert len(ours.handlers) == 1 and ours.getEffectiveLevel() == logging.INFO
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("INFO ")]
    assert any(" pyxllm." in line for line in lines), lines
