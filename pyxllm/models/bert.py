"""BERT encoders: ``BertModel`` (sentence-transformers' all-MiniLM-L6-v2) for the embed task,
``BertForSequenceClassification`` (cross-encoders such as cross-encoder/ms-marco-MiniLM-L-6-v2,
and classifiers) for the score and classify tasks: bidirectional attention over each whole
prompt, no KV cache, post-norm residuals; the hidden states go to the executor's pooler.

Follows transformers' ``modeling_bert.py`` (absolute positions, no dropout at inference); the
checkpoint's ``query``/``key``/``value`` load into one fused ``qkv_proj``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyxllm.layers.attention import EncoderAttention
from pyxllm.layers.layernorm import LayerNorm
from pyxllm.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pyxllm.layers.vocab_embedding import VocabParallelEmbedding


class BertEmbeddings(nn.Module):
    """Token + absolute position + token-type embeddings, then LayerNorm:
    ``forward(input_ids, positions, token_type_ids=None [T] int64) -> [T, hidden]``
    (``token_type_ids`` ``None``: every token's type is 0)."""

    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden)
        self.position_embeddings = VocabParallelEmbedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = VocabParallelEmbedding(config.type_vocab_size, hidden)
        self.LayerNorm = LayerNorm(hidden, config.layer_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertLayer(nn.Module):
    """One encoder layer: self-attention and a GELU MLP, each added to its input and then
    LayerNorm-ed (post-norm): ``[T, hidden] -> [T, hidden]``."""

    def __init__(self, config) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // heads
        eps = config.layer_norm_eps
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, heads, bias=True)
        self.attn = EncoderAttention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5)
        self.attn_dense = RowParallelLinear(hidden, hidden, bias=True)
        self.attn_norm = LayerNorm(hidden, eps)
        self.intermediate = ColumnParallelLinear(hidden, config.intermediate_size, bias=True)
        self.output = RowParallelLinear(config.intermediate_size, hidden, bias=True)
        self.output_norm = LayerNorm(hidden, eps)
        self.q_size = self.qkv_proj.num_heads * head_dim
        if config.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(
                f"BertModel: activation {config.hidden_act!r} is not supported; supported: gelu, "
                "gelu_new, gelu_pytorch_tanh"
            )
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size] * 3, dim=-1)
        x = self.attn_norm(x + self.attn_dense(self.attn(q, k, v)))
        h = F.gelu(self.intermediate(x), approximate=self.approximate)
        return self.output_norm(x + self.output(h))


class BertModel(nn.Module):
    """A BERT encoder: ``forward(input_ids, positions, token_type_ids=None [T] int64) ->
    [T, hidden]``, the last layer's hidden states of whole sequences laid end to end
    (``positions`` restart at 0 for each; ``token_type_ids`` ``None``: all 0). Run by
    :class:`~pyxllm.executor.pooling_executor.PoolingExecutor`.

    Checkpoint names are transformers' (``embeddings.*``, ``encoder.layer.{i}.attention.self.
    query.weight`` ...), with or without a ``bert.`` prefix (see
    :meth:`rename_checkpoint_tensor`).

    Raises:
        ValueError: an activation other than GELU, or a position embedding type other than
            absolute.
    """

    is_pooling_model = True
    # checkpoint tensors it does not use: the position-id buffer, and the NSP pooler (a tanh
    # dense layer over [CLS]) that sentence-transformers' pooling replaces
    unused_tensors: tuple[str, ...] = ("embeddings.position_ids", "pooler.")
    default_pooling_type = "CLS"  # vLLM's for BERT without sentence-transformers' modules
    packed_modules_mapping = {
        "query": ("qkv_proj", "q"),
        "key": ("qkv_proj", "k"),
        "value": ("qkv_proj", "v"),
    }
    # transformers' module paths -> ours (after the packed mapping's names)
    _RENAMES = (
        (".attention.self.", "."),
        (".attention.output.dense.", ".attn_dense."),
        (".attention.output.LayerNorm.", ".attn_norm."),
        (".intermediate.dense.", ".intermediate."),
        (".output.dense.", ".output."),
        (".output.LayerNorm.", ".output_norm."),
    )

    def __init__(self, config) -> None:
        super().__init__()
        kind = getattr(config, "position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(
                f"BertModel: position_embedding_type {kind!r} is not supported (only absolute)"
            )
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            BertLayer(config) for _ in range(config.num_hidden_layers)
        )

    def rename_checkpoint_tensor(self, name: str) -> str | None:
        """Our parameter name for checkpoint tensor ``name``; ``None`` for one the model does
        not use (:attr:`unused_tensors`)."""
        name = name.removeprefix("bert.")
        if name.startswith(self.unused_tensors):
            return None
        for old, new in self._RENAMES:
            name = name.replace(old, new)
        return name

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x)
        return x


class BertForSequenceClassification(BertModel):
    """A BERT encoder with transformers' sequence-classification head: ``forward`` as
    :class:`BertModel`'s, and :meth:`classify` over each sequence's [CLS] hidden state (the
    BERT pooler, a tanh dense layer, then the ``classifier`` linear layer to ``num_labels``
    logits). A cross-encoder (one label) scores a text pair, its segments told apart by
    ``token_type_ids``; the activation (sigmoid, softmax) is the executor's pooler's.

    Checkpoint names: :class:`BertModel`'s, plus ``bert.pooler.dense.*`` and ``classifier.*``.
    """

    unused_tensors = ("embeddings.position_ids",)

    def __init__(self, config) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.pooler = nn.Module()
        self.pooler.dense = ReplicatedLinear(hidden, hidden, bias=True)
        self.classifier = ReplicatedLinear(hidden, config.num_labels, bias=True)

    def classify(self, cls_states: torch.Tensor) -> torch.Tensor:
        """``cls_states [N, hidden]`` (each sequence's first token, in the model's dtype) ->
        logits ``[N, num_labels]``."""
        return self.classifier(torch.tanh(self.pooler.dense(cls_states)))
