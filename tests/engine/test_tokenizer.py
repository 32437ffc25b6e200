"""Tokenizer wrapper on the real SmolLM2 tokenizer: encode/decode, EOS ids, chat templates."""

from __future__ import annotations

import copy

import pytest

from pyxllm.engine.tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "中国的首都是哪里？"},
]


@pytest.fixture(scope="module")
def tok(hf_gguf_tokenizer):
    return Tokenizer(hf_gguf_tokenizer)


def _with_template(hf, template):
    other = copy.copy(hf)
    other.chat_template = template
    return Tokenizer(other)


def test_basic_attributes(tok, hf_gguf_tokenizer):
    assert tok.hf is hf_gguf_tokenizer
    assert tok.vocab_size == len(hf_gguf_tokenizer) == 49152
    assert tok.eos_token_ids == frozenset({hf_gguf_tokenizer.eos_token_id})
    extra = Tokenizer(hf_gguf_tokenizer, eos_token_ids=[0, 2])
    assert extra.eos_token_ids == frozenset({0, hf_gguf_tokenizer.eos_token_id, 2})


def test_encode_decode_round_trip(tok):
    ids = tok.encode("The capital of France is Paris.")
    assert ids == [504, 3575, 282, 4649, 314, 7042, 30]
    assert tok.convert_ids_to_tokens(ids[:2]) == ["The", "Ġcapital"]
    assert tok.decode(ids) == "The capital of France is Paris."
    end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(ids[:1] + [end]) == "The"
    assert tok.decode(ids[:1] + [end], skip_special_tokens=False) == "The<|im_end|>"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_long_decode_equals_transformers(tok, skip_special_tokens):
    """At LONG_DECODE_TOKENS ids and beyond decoding takes the GIL-free batch call of the Rust
    tokenizer: the text is transformers' own, special tokens, a split UTF-8 character and
    spaces included."""
    from pyxllm.engine.tokenizer import LONG_DECODE_TOKENS

    assert tok._backend is not None  # the default model's tokenizer takes the fast path
    end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    piece = tok.encode("a , b 's 中国 ", add_special_tokens=False) + [end]
    ids = (piece * (LONG_DECODE_TOKENS // len(piece) + 1))[: LONG_DECODE_TOKENS + 1]
    ids[-1] = tok.encode("🦊", add_special_tokens=False)[0]  # the first bytes of a character
    expected = tok.hf.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )
    assert tok.decode(ids, skip_special_tokens) == expected
    assert tok.decode(tuple(ids), skip_special_tokens) == expected
    assert ("<|im_end|>" in expected) != skip_special_tokens


def test_token_bytes_join_into_the_text(tok):
    """Each token's bytes (OpenAI's logprob ``bytes``), joined, are the text's UTF-8, though
    the three tokens of an emoji each decode alone to U+FFFD; a special token's are its text."""
    text = "🦊 café, 中国! <|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode_each(ids).count("\ufffd") >= 2  # the fox's pieces
    assert b"".join(tok.token_bytes(t) for t in ids) == text.encode()
    assert tok.token_bytes(ids[0]) == "🦊".encode()[: len(tok.token_bytes(ids[0]))]


class _SentencePieceLike:
    """The little of a SentencePiece tokenizer that ``token_bytes`` reads (byte fallback)."""

    eos_token_id = 2
    pieces = {3: "<0xE4>", 4: "<0xB8>", 5: "<0xAD>", 6: "\u2581hello", 7: "é"}

    def __len__(self):
        return 8

    def convert_ids_to_tokens(self, token_id):
        return self.pieces.get(token_id)


def test_token_bytes_of_sentencepiece_pieces():
    tok = Tokenizer(_SentencePieceLike())
    assert b"".join(tok.token_bytes(t) for t in (6, 3, 4, 5, 7)) == " hello中é".encode()


def test_decode_does_not_clean_up_spaces(tok):
    text = "a , b . c 's"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_template_matches_transformers(tok, hf_gguf_tokenizer):
    ids = tok.apply_chat_template(MESSAGES)
    text = hf_gguf_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert ids == hf_gguf_tokenizer.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    no_gen = tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert ids[: len(no_gen)] == no_gen and len(no_gen) < len(ids)


def test_template_kwargs_reach_the_template(hf_gguf_tokenizer):
    t = _with_template(
        hf_gguf_tokenizer,
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n{% endif %}"
        "{% endif %}",
    )
    msgs = [{"role": "user", "content": "hi"}]
    off = t.decode(t.apply_chat_template(msgs, enable_thinking=False), skip_special_tokens=False)
    on = t.decode(t.apply_chat_template(msgs, enable_thinking=True), skip_special_tokens=False)
    assert off.endswith("assistant\n<think>\n\n</think>\n")
    assert on.endswith("<|im_start|>assistant\n")


def test_no_chat_template_raises(hf_gguf_tokenizer):
    t = _with_template(hf_gguf_tokenizer, None)
    with pytest.raises(ValueError, match="chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty"),
        ([{"content": "hi"}], "role"),
        ([{"role": "user"}], "content"),
        (["hi"], r"messages\[0\]"),
        ([{"role": "user", "content": 3}], "content"),
    ],
)
def test_malformed_messages_raise(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_template_errors_become_value_error(hf_gguf_tokenizer):
    t = _with_template(hf_gguf_tokenizer, "{{ raise_exception('only user messages') }}")
    with pytest.raises(ValueError, match="only user messages"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])
    broken = _with_template(hf_gguf_tokenizer, "{% for m in messages %}")
    with pytest.raises(ValueError, match="chat template"):
        broken.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="tokenize"):
        Tokenizer(hf_gguf_tokenizer).apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=True
        )
