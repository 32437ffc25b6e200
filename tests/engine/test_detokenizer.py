"""IncrementalDetokenizer on the real SmolLM2 tokenizer: UTF-8 safety, stop strings, specials."""

from __future__ import annotations

import random

import pytest

from pyxllm.engine.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer
from pyxllm.engine.tokenizer import Tokenizer

FFFD = "\ufffd"
SENTENCE = "The capital of France is Paris."


@pytest.fixture(scope="module")
def tok(hf_gguf_tokenizer):
    return Tokenizer(hf_gguf_tokenizer)


@pytest.fixture(scope="module")
def prompt_ids(tok):
    return tok.apply_chat_template([{"role": "user", "content": "Tell me something."}])


class _CountingTokenizer(Tokenizer):
    """Records the length of every decode, to check the window stays short."""

    def __init__(self, hf):
        super().__init__(hf)
        self.decode_lengths: list[int] = []

    def decode(self, token_ids, skip_special_tokens=True):
        self.decode_lengths.append(len(token_ids))
        return super().decode(token_ids, skip_special_tokens)


def stream(tok, prompt, out_ids, **kwargs):
    """Feed ``out_ids`` one at a time; check the streaming invariants; return (deltas, detok, stop,
    step)."""
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    deltas, prev, stop, stop_step = [], "", None, None
    for step, t in enumerate(out_ids):
        stop = detok.update([t])
        text = detok.output_text
        assert text.startswith(prev), (prev, text)  # only ever grows
        assert not text.endswith(FFFD), text  # never a partial character
        deltas.append(text[len(prev) :])
        prev = text
        if stop is not None:
            stop_step = step
            break
    if stop is None:
        final = detok.finish()
        assert final.startswith(prev)
        deltas.append(final[len(prev) :])
    assert "".join(deltas) == detok.output_text
    return deltas, detok, stop, stop_step


@pytest.mark.parametrize(
    "text",
    [
        SENTENCE,
        "中国的首都是哪里？",
        "Party time 😀🎉 ok!",
        "naïve café – 日本語 🇫🇷 done",
        "  two  spaces\n\nnew",
    ],
)
def test_round_trip_one_token_at_a_time(tok, prompt_ids, text):
    out_ids = tok.encode(text, add_special_tokens=False)
    deltas, detok, stop, _ = stream(tok, prompt_ids, out_ids)
    assert stop is None
    assert detok.output_text == tok.decode(out_ids) == text
    assert FFFD not in "".join(deltas)


def test_split_characters_are_held_not_replaced(tok, prompt_ids):
    out_ids = tok.encode("中国的首都是哪里？", add_special_tokens=False)
    # The test is meaningful only if some tokens are partial characters on their own.
    assert any(FFFD in tok.decode([t]) for t in out_ids)
    deltas, detok, _, _ = stream(tok, prompt_ids, out_ids)
    assert "" in deltas[:-1]  # some step held its bytes back
    assert detok.output_text == "中国的首都是哪里？"


def test_leading_space_of_first_token_kept(tok):
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    out_ids = tok.encode(" Paris.", add_special_tokens=False)
    _, detok, _, _ = stream(tok, prompt, out_ids)
    assert detok.output_text == " Paris."


def test_several_tokens_per_update(tok, prompt_ids):
    out_ids = tok.encode("Emoji 😀🎉 and 中国", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    for i in range(0, len(out_ids), 3):
        assert detok.update(out_ids[i : i + 3]) is None
    assert detok.finish() == "Emoji 😀🎉 and 中国"


def test_window_stays_short(hf_gguf_tokenizer, prompt_ids):
    counting = _CountingTokenizer(hf_gguf_tokenizer)
    text = " ".join(["中国的首都是北京 😀 and Paris is in France."] * 20)
    out_ids = counting.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(counting, prompt_ids)
    counting.decode_lengths.clear()
    for t in out_ids:
        detok.update([t])
    assert detok.finish() == text
    assert len(out_ids) > 200
    assert max(counting.decode_lengths) <= 12  # never the whole output
    assert len(counting.decode_lengths) <= 2 * len(out_ids)


def test_invalid_bytes_do_not_stall_or_grow_the_window(hf_gguf_tokenizer, prompt_ids):
    counting = _CountingTokenizer(hf_gguf_tokenizer)
    lead_byte = counting.hf.convert_tokens_to_ids("å")  # the byte 0xE5 alone: a 3-byte lead
    assert counting.decode([lead_byte]) == FFFD
    out_ids = [lead_byte] * (3 * MAX_PENDING_TOKENS) + counting.encode(
        " ok", add_special_tokens=False
    )
    _, detok, _, _ = stream(counting, prompt_ids, out_ids)
    assert detok.output_text.endswith(" ok")
    assert max(counting.decode_lengths) <= MAX_PENDING_TOKENS + 8


def test_incomplete_tail_dropped_by_finish(tok, prompt_ids):
    emoji = tok.encode(" 😀", add_special_tokens=False)
    assert len(emoji) >= 2
    detok = IncrementalDetokenizer(tok, prompt_ids)
    detok.update(tok.encode("Hi", add_special_tokens=False))
    detok.update(emoji[:-1])  # the emoji's last byte never comes
    assert detok.finish() == "Hi "  # the space before the cut emoji is real, its bytes are not
    assert detok.finished


def test_random_token_sequences_match_full_decode(tok, prompt_ids):
    rng = random.Random(0)
    byte_tokens = [t for t in range(tok.vocab_size) if FFFD in tok.decode([t])]
    assert len(byte_tokens) > 50
    for _ in range(30):
        ids = [
            rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(tok.vocab_size)
            for _ in range(40)
        ]
        _, detok, _, _ = stream(tok, prompt_ids, ids)
        assert detok.output_text == tok.decode(ids).rstrip(FFFD)


def test_stop_string_across_token_boundary(tok, prompt_ids):
    out_ids = tok.encode(SENTENCE, add_special_tokens=False)
    assert tok.convert_ids_to_tokens(out_ids)[4:6] == ["Ġis", "ĠParis"]
    deltas, detok, stop, step = stream(tok, prompt_ids, out_ids, stop=["is Pa"])
    assert stop == "is Pa" and step == 5 and detok.stop_reason == "is Pa"
    assert detok.output_text == "The capital of France "
    assert "i" not in "".join(deltas[4:])  # nothing of the stop string was ever streamed
    with pytest.raises(RuntimeError):
        detok.update(out_ids[6:])
    assert detok.finish() == "The capital of France "  # idempotent after a stop


def test_stop_string_included(tok, prompt_ids):
    out_ids = tok.encode(SENTENCE, add_special_tokens=False)
    _, detok, stop, _ = stream(
        tok, prompt_ids, out_ids, stop=["is Pa"], include_stop_str_in_output=True
    )
    assert stop == "is Pa"
    assert detok.output_text == "The capital of France is Pa"


def test_partial_stop_match_is_held_then_released(tok, prompt_ids):
    out_ids = tok.encode(SENTENCE, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["is Lyon"])
    seen = []
    for t in out_ids:
        assert detok.update([t]) is None
        seen.append(detok.output_text)
    assert seen[4] == "The capital of France "  # "is" could start the stop string: held
    assert seen[5] == "The capital of France is Par"  # released; but Paris ends in "is" again
    assert seen[6] == SENTENCE
    assert detok.finish() == SENTENCE


def test_held_stop_prefix_released_by_finish(tok, prompt_ids):
    out_ids = tok.encode("The capital of France is Par", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["Paris!"])
    for t in out_ids:
        detok.update([t])
    assert detok.output_text == "The capital of France is "
    assert detok.finish() == "The capital of France is Par"
    assert detok.stop_reason is None


def test_first_ending_stop_wins(tok, prompt_ids):
    out_ids = tok.encode(SENTENCE, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["France is Paris", "capital"])
    assert detok.update(out_ids) == "capital"  # all at once: the match that ends first
    assert detok.output_text == "The "


def test_stop_inside_multibyte_text(tok, prompt_ids):
    out_ids = tok.encode("中国的首都是哪里？", add_special_tokens=False)
    _, detok, stop, _ = stream(tok, prompt_ids, out_ids, stop=["首都"])
    assert stop == "首都"
    assert detok.output_text == "中国的"


@pytest.mark.parametrize(
    "skip, expected", [(True, "Hello there"), (False, "Hello there<|im_end|>")]
)
def test_skip_special_tokens(tok, prompt_ids, skip, expected):
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    out_ids = tok.encode("Hello there", add_special_tokens=False) + [im_end]
    _, detok, _, _ = stream(tok, prompt_ids, out_ids, skip_special_tokens=skip)
    assert detok.output_text == expected


@pytest.mark.parametrize("min_tokens", [0, 3, 5])
def test_min_tokens_defers_stop_strings(tok, prompt_ids, min_tokens):
    """A stop string only matches in the text of tokens after the first ``min_tokens`` (an "e"
    those tokens already showed does not count later), as vLLM's detokenizer does."""
    text = " is Lee, and I'm a student in the college of engineering"
    out_ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode(out_ids[: i + 1]) for i in range(len(out_ids))]
    # the reference: the first "e" in text added by a token past min_tokens
    start = len(pieces[min_tokens - 1]) if min_tokens else 0
    expected = text[: text.index("e", start)]
    _, detok, stop, _ = stream(tok, prompt_ids, out_ids, stop=["e"], min_tokens=min_tokens)
    assert stop == "e" and detok.output_text == expected
    if min_tokens:
        assert "e" in expected  # the deferred stop let an earlier "e" through
