"""Any transformers causal LM inside pyxllm's engine (``--model-impl transformers``).

vLLM's Transformers backend, the same way: transformers builds the model from its config, and
its attention interface (``AttentionInterface.register``, selected by ``attn_implementation``)
sends every attention call to pyxllm's paged attention, so the scheduler, paged KV cache,
prefix cache, chunked prefill, preemption and sampler apply unchanged. The whole step's tokens
run as one sequence of a batch of one (``input_ids [1, T]``, ``position_ids [1, T]``): rotary
embeddings and every per-token layer are exact for any mix of sequences, and attention, the one
layer that mixes tokens, reads each sequence's own context from the cache.

- Which models: those whose class declares ``_supports_attention_backend`` (transformers' flag
  for "attention goes only through the interface"); others (state-space and convolution layers
  mix tokens outside attention) are refused by name.
- No attention mask is built: the attention name is not one transformers' mask interface knows,
  so ``create_causal_mask`` returns None and the paged kernels apply causality, each layer's
  ``sliding_window`` and ``softcap`` (the keyword arguments transformers passes).
- Every ``nn.Linear`` of the decoder becomes a pyxllm linear layer, so ``--quantization``
  applies; with ``--tensor-parallel-size`` > 1 those the config's ``base_model_tp_plan`` names
  ``colwise`` / ``rowwise`` become column / row parallel (a model without a plan is refused).
- Weights load through pyxllm's readers into the model's own parameters (created empty, with
  transformers' initialization skipped): one copy in memory.
- Logits: the model's own head and post-processing (Gemma's final soft-capping, Granite's
  logit scaling) run on the sampled rows only, by calling the causal LM's ``forward`` with its
  base model swapped for one that returns the given hidden states.
"""

from __future__ import annotations

import fnmatch

import torch
import transformers
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

from pyxllm.distributed.parallel_state import get_tp_rank, get_tp_size
from pyxllm.layers.attention import Attention, paged_attention
from pyxllm.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from pyxllm.models.config_utils import head_dim_of

ATTN_IMPLEMENTATION = "pyxllm"
_TP_STYLES = {"colwise": ColumnParallelLinear, "rowwise": RowParallelLinear}


def pyxllm_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over pyxllm's paged attention.

    ``query [1, heads, T, head_dim]``, ``key``/``value [1, kv_heads, T, head_dim]`` (the step's
    tokens) -> ``([1, T, heads, head_dim], None)``; the layer is ``module.layer_idx``, the scale
    ``scaling`` (default ``head_dim ** -0.5``). ``attention_mask`` is None (see the module
    docstring); dropout is off at inference.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    out = paged_attention(q, k, v, module.layer_idx, scale, sliding_window, softcap)
    return out.unsqueeze(0), None


class _GivenHiddenStates(nn.Module):
    """Stands in for a causal LM's base model: returns the hidden states it is given as
    ``inputs_embeds``, so the causal LM's ``forward`` runs only its head.

    Any submodule the head reaches for is this module again (OPT's head calls
    ``self.model.decoder``), and the output has every field a head reads (GPT-2's reads
    ``cross_attentions``), each None but the hidden states.
    """

    def forward(self, *args, inputs_embeds: torch.Tensor, **kwargs):
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=inputs_embeds)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):  # copy/pickle protocols and private state: really absent
                raise
            return self


def _register_attention() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, pyxllm_attention_forward)


def transformers_class(config) -> type:
    """transformers' class for ``config.architectures`` (the first one transformers has; for a
    config that names none, ``AutoModelForCausalLM``'s class for its type).

    Raises:
        ValueError: transformers has none of them (remote code is not run), or its attention
            cannot be routed to pyxllm's (naming the class).
    """
    archs = list(getattr(config, "architectures", None) or [])
    if archs:
        classes = [getattr(transformers, arch, None) for arch in archs]
    else:
        classes = [transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)]
    cls = next((c for c in classes if isinstance(c, type)), None)
    if cls is None:
        raise ValueError(
            f"transformers {transformers.__version__} has no model class "
            f"{' or '.join(archs) or '(no architectures in config.json)'}"
        )
    if not cls.is_backend_compatible():
        raise ValueError(
            f"transformers' {cls.__name__} does not route its attention through transformers' "
            "attention interface, so it cannot run on pyxllm's paged KV cache"
        )
    return cls


def _replace_linears(base: nn.Module, config, tp_size: int) -> None:
    """Swap every ``nn.Linear`` under ``base`` for a pyxllm linear layer: a whole
    ``LinearBase`` at TP size 1; at larger sizes the layers the config's ``base_model_tp_plan``
    marks ``colwise`` / ``rowwise`` (transformers' patterns, relative to ``base``) are split and
    the others stay whole (as do embeddings and norms, whatever the plan says of them).

    Raises:
        ValueError: TP > 1 for a model without a TP plan, or whose plan splits a linear layer
            another way (e.g. ``colwise_gather_output``), naming the layer and the style.
    """
    plan = (getattr(config, "base_model_tp_plan", None) or {}) if tp_size > 1 else {}
    if tp_size > 1 and not plan:
        raise ValueError(
            f"--tensor-parallel-size {tp_size}: {type(config).__name__} declares no TP plan "
            "(base_model_tp_plan), so --model-impl transformers runs it only with TP size 1"
        )
    for name, module in list(base.named_modules()):
        if type(module) is not nn.Linear:
            continue
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is not None and style not in _TP_STYLES:
            raise ValueError(
                f"--tensor-parallel-size {tp_size}: the TP plan of {type(config).__name__} "
                f"splits {name} as {style}; pyxllm splits linear layers only "
                f"{' or '.join(_TP_STYLES)}"
            )
        cls = LinearBase if style is None else _TP_STYLES[style]
        parent_name, _, child = name.rpartition(".")
        layer = cls(module.in_features, module.out_features, bias=module.bias is not None)
        setattr(base.get_submodule(parent_name), child, layer)


def _checkpoint_renamer(causal_lm: nn.Module):
    """``checkpoint name -> parameter name`` by the renamings transformers applies when it
    loads this model (e.g. GPT-NeoX's ``embed_out`` is ``lm_head`` in transformers 5).

    The function raises ValueError for a tensor transformers would first merge with others
    (a ``WeightConverter``, e.g. per-expert tensors fused into one): pyxllm's loader does not.
    """
    # here, not at the top: transformers 5's modules (pyproject allows 4.56), which only
    # building the model needs
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(causal_lm)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def rename(name: str) -> str:
        renamed, converted_by = rename_source_key(name, renamings, converters)
        if converted_by is not None:
            raise ValueError(
                f"checkpoint tensor {name!r} is merged with others when transformers loads "
                f"{type(causal_lm).__name__} (pattern {converted_by!r}); pyxllm's loader does "
                "not merge tensors for --model-impl transformers"
            )
        return renamed

    return rename


class TransformersForCausalLM(nn.Module):
    """A transformers causal LM (the class named by ``config.architectures``) as a pyxllm model:
    the same interface as the native ones.

    ``forward(input_ids [T] int64, positions [T] int64) -> hidden [T, hidden]``;
    ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` float32. Parameter names are the
    checkpoint's (the causal LM's children are this module's children). One parameterless
    :class:`~pyxllm.layers.attention.Attention` per layer describes the KV cache
    (``attn_layers``).

    Raises:
        ValueError: a model transformers cannot run here (see the module docstring), or TP
            sizes the heads or the plan do not allow.
    """

    model_impl = "transformers"

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.initialization import no_init_weights  # transformers 5's: see above

        _register_attention()
        cls = transformers_class(config)
        tp_size = get_tp_size()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        if num_kv_heads % tp_size or num_heads % tp_size:
            raise ValueError(
                f"--tensor-parallel-size {tp_size}: must divide the {num_heads} attention and "
                f"{num_kv_heads} KV heads"
            )
        config._attn_implementation = ATTN_IMPLEMENTATION
        with no_init_weights():
            causal_lm = cls(config)
        causal_lm.tie_weights()  # skipped with the initialization
        causal_lm.eval().requires_grad_(False)  # inference only, as pyxllm's own layers
        self.config = config
        self.rename_checkpoint_tensor = _checkpoint_renamer(causal_lm)
        prefix = causal_lm.base_model_prefix
        base = getattr(causal_lm, prefix)
        _replace_linears(base, config, tp_size)
        for name, child in causal_lm.named_children():
            self.add_module(name, child)
        # the causal LM without its base model: the head and its logit post-processing
        causal_lm._modules[prefix] = _GivenHiddenStates()
        self._base_prefix, self._head_only = prefix, [causal_lm]  # a list: not a submodule
        head_dim = head_dim_of(config)
        self.attn_layers = nn.ModuleList(
            Attention(num_heads // tp_size, head_dim, head_dim**-0.5, num_kv_heads // tp_size, i)
            for i in range(config.num_hidden_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = getattr(self, self._base_prefix)(
            input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False
        )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if get_tp_rank() != 0:  # the head is whole on every rank; rank 0 samples
            return None
        out = self._head_only[0](inputs_embeds=hidden_states.unsqueeze(0), use_cache=False)
        return out.logits[0].float()
