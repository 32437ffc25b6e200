"""The engine loop's helpers: loading the model on a thread of its own."""

from __future__ import annotations

import threading

import pytest

from pyxllm.engine.engine_loop import load_on_own_thread


def test_load_on_own_thread_returns_from_another_thread_that_has_ended():
    seen: list[threading.Thread] = []

    def load() -> int:
        seen.append(threading.current_thread())
        return 42

    assert load_on_own_thread(load) == 42
    assert seen[0] is not threading.current_thread() and seen[0].name == "pyxllm-load"
    assert not seen[0].is_alive()  # its OpenMP team, if it made one, is gone with it


def test_load_on_own_thread_raises_what_the_load_raised():
    def load() -> None:
        raise ValueError("--model: no such file")

    with pytest.raises(ValueError, match="--model: no such file"):
        load_on_own_thread(load)
