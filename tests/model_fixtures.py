"""Builders of tiny random Hugging Face checkpoints (config.json + safetensors + tokenizer).

Every checkpoint uses the SmolLM2 tokenizer (pass the conftest fixture ``hf_gguf_tokenizer``),
so ``vocab_size`` is 49152, and is saved in float32 unless asked otherwise. Weights are drawn
with ``initializer_range`` well above the usual 0.02 so greedy continuations vary from token to
token instead of repeating one token.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 49152
# Large enough that logits spread out (tokens vary), small enough to keep activations sane.
INIT_RANGE = 0.25
# Sliding window of the windowed kinds, in tokens: shorter than most test prompts plus outputs.
WINDOW = 6

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=INIT_RANGE,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(kind: str, **overrides):
    """A transformers config for ``kind``: ``llama`` (untied), ``qwen2`` (tied), ``qwen3``
    (untied, ``head_dim`` 32 while hidden/heads is 16), ``qwen3_moe`` (4 experts, top-2,
    renormalised, layer 1 dense through ``mlp_only_layers``), ``mistral`` (a sliding window of
    :data:`WINDOW` tokens in every layer) or ``qwen2_sliding`` (layer 0 full, layer 1 a window
    of :data:`WINDOW`, through ``max_window_layers``), ``gemma3`` (tied, ``head_dim`` 32,
    layers local-local-global-local with a window of :data:`WINDOW`, local RoPE theta 10,000 and
    global 1,000,000, ``query_pre_attn_scalar`` 24 so a ``head_dim`` scale shows) or ``gemma2``
    (tied, ``head_dim`` 16, local and global alternating, Gemma 2's soft caps: 50 on attention
    scores, 30 on logits; each moves the last logits by more than 0.03). ``overrides`` replace
    the common fields (e.g. ``vocab_size=len(tokenizer)`` for a tokenizer with added tokens).

    Gemma's configs in transformers 5.24: ``sliding_window`` counts the attended tokens with the
    current one (``kv > q - sliding_window``); ``Gemma3TextConfig.rope_parameters`` is a dict
    keyed by layer type (``{"sliding_attention": {"rope_type", "rope_theta"},
    "full_attention": {...}}``), built from the older ``rope_theta``/``rope_local_base_freq``/
    ``rope_scaling`` when those are given; Gemma 2's is one dict for every layer.

    ``phi3`` (LongRoPE, partial rotary, a window; overrides replace its own fields too): see
    :func:`phi3_config`.

    Raises:
        KeyError: an unknown kind.
    """
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = {**_COMMON, **overrides}
    builders = {
        **_transformers_only(common),
        "llama": lambda: LlamaConfig(
            **common, intermediate_size=128, num_hidden_layers=2, tie_word_embeddings=False
        ),
        "qwen2": lambda: Qwen2Config(
            **common, intermediate_size=128, num_hidden_layers=2, tie_word_embeddings=True
        ),
        "qwen3": lambda: Qwen3Config(
            **common,
            intermediate_size=128,
            num_hidden_layers=2,
            head_dim=32,
            tie_word_embeddings=False,
        ),
        "mistral": lambda: MistralConfig(
            **common,
            intermediate_size=128,
            num_hidden_layers=2,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
        ),
        "qwen2_sliding": lambda: Qwen2Config(
            **common,
            intermediate_size=128,
            num_hidden_layers=2,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
        "phi3": lambda: phi3_config(common),
        "qwen3_moe": lambda: Qwen3MoeConfig(
            **common,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
        "gemma3": lambda: Gemma3TextConfig(
            **common,
            intermediate_size=128,
            num_hidden_layers=4,
            head_dim=32,
            layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            tie_word_embeddings=True,
        ),
        "gemma2": lambda: Gemma2Config(
            **common,
            intermediate_size=128,
            num_hidden_layers=4,
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        ),
    }
    return builders[kind]()


def phi3_config(common: dict):
    """The ``phi3`` kind: Phi-3 (untied) with fused ``qkv_proj``/``gate_up_proj``, a partial
    rotary factor of 0.75 (12 of each head's 16 channels turn), a sliding window of
    :data:`WINDOW` in every layer, and LongRoPE (``rope_scaling`` type ``longrope``) with
    distinct short and long factors (6 each: half the rotary width) and
    ``original_max_position_embeddings`` 128 (half of ``max_position_embeddings``: attention
    factor ~1.07). pyxllm takes the long factors only when ``--max-model-len`` exceeds 128;
    override ``original_max_position_embeddings`` (e.g. 32) to run them. Overrides replace any
    of these too (``sliding_window=None``, ``rope_scaling=None``, ``tie_word_embeddings=True``:
    Phi-4-mini's shape)."""
    from transformers import Phi3Config

    half = int(common["hidden_size"] // common["num_attention_heads"] * 0.75) // 2
    fields = {
        "original_max_position_embeddings": 128,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "partial_rotary_factor": 0.75,
        "sliding_window": WINDOW,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [3.0 + 2.0 * i for i in range(half)],
        },
        "tie_word_embeddings": False,
        **common,
    }
    return Phi3Config(**fields)


# Architectures pyxllm has no native code for: they run through ``--model-impl transformers``.
TRANSFORMERS_ONLY_KINDS = ("olmo2", "granite", "gpt_neox")
# ...and more, whose heads differ: GPT-2's (Conv1D layers, learned positions, an EOS id past this
# vocabulary), OPT's (its causal LM calls ``model.decoder``), Cohere's (``logit_scale``)
TRANSFORMERS_HEAD_KINDS = ("gpt2", "opt", "cohere")


def _transformers_only(common: dict) -> dict:
    """Builders of :data:`TRANSFORMERS_ONLY_KINDS` (OLMo 2: q/k norms over whole projections,
    post-norms; Granite: embedding, attention, residual and logit multipliers; GPT-NeoX: fused
    QKV, partial rotary, parallel residual, LayerNorm, no GQA) and of
    :data:`TRANSFORMERS_HEAD_KINDS`."""
    from transformers import (
        CohereConfig,
        GPT2Config,
        GPTNeoXConfig,
        GraniteConfig,
        Olmo2Config,
        OPTConfig,
    )

    sizes = dict(vocab_size=VOCAB_SIZE, initializer_range=INIT_RANGE)
    return {
        "gpt2": lambda: GPT2Config(**sizes, n_embd=64, n_layer=2, n_head=4, n_positions=256),
        "opt": lambda: OPTConfig(
            **sizes,
            hidden_size=64,
            num_hidden_layers=2,
            ffn_dim=128,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
            init_std=INIT_RANGE,
        ),  # fmt: skip
        "cohere": lambda: CohereConfig(
            **common, intermediate_size=128, num_hidden_layers=2, logit_scale=0.5
        ),
        "olmo2": lambda: Olmo2Config(**common, intermediate_size=128, num_hidden_layers=2),
        "granite": lambda: GraniteConfig(
            **common,
            intermediate_size=128,
            num_hidden_layers=2,
            embedding_multiplier=2.0,
            attention_multiplier=0.2,
            residual_multiplier=0.5,
            logits_scaling=0.5,
            tie_word_embeddings=True,
        ),
        "gpt_neox": lambda: GPTNeoXConfig(
            **{k: v for k, v in common.items() if k != "num_key_value_heads"},
            intermediate_size=128,
            num_hidden_layers=2,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            use_parallel_residual=True,
            tie_word_embeddings=False,
        ),  # fmt: skip
    }


def build_hf_model(config, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A randomly initialised transformers causal LM for ``config`` (eval mode, ``dtype``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # norms init to ones (Gemma's to zeros, for a scale of 1 + w); jitter them so a mix-up of
    # norm weights, or a scale of w for 1 + w, shows. Gemma's post-attention and post-MLP norms
    # scale by about 10, as trained Gemmas' large ones do: else the tied embedding, scaled by
    # sqrt(hidden), outweighs the layers and continuations repeat their first token.
    gemma = config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            if gemma and name.endswith(_GEMMA_POST_NORMS):
                param.add_(9.0)
    return model.to(dtype).eval()


_GEMMA_POST_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")


def save_checkpoint(
    model,
    directory: Path,
    tokenizer,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save ``model`` (safetensors, config.json declaring ``dtype``) and ``tokenizer`` into
    ``directory``.

    With ``max_shard_size`` (e.g. ``"2MB"``) the weights are split over several files plus
    ``model.safetensors.index.json``. Returns ``directory``.
    """
    directory = Path(directory)
    model.config.dtype = dtype
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    tokenizer.save_pretrained(directory)
    return directory


def build_checkpoint(
    kind: str,
    directory: Path,
    tokenizer,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
):
    """Build a tiny ``kind`` checkpoint (see :func:`tiny_config`) in ``directory``.

    Returns ``(directory, hf_model)``: the transformers model whose weights were saved, the
    reference.
    """
    model = build_hf_model(tiny_config(kind), seed, dtype)
    return save_checkpoint(model, directory, tokenizer, max_shard_size, dtype), model


# A Qwen3-like chat template: enable_thinking=false closes an empty think block in the prompt.
THINKING_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def thinking_tokenizer(tokenizer, special: bool = False):
    """A copy of ``tokenizer`` with ``<think>`` and ``</think>`` added as single tokens (not
    special, as in Qwen3, unless ``special``) and :data:`THINKING_CHAT_TEMPLATE`. Build its
    checkpoint with ``vocab_size=len(copy)``."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(["<think>", "</think>"], special_tokens=special)
    tok.chat_template = THINKING_CHAT_TEMPLATE
    return tok
