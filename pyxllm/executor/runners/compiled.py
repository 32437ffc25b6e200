"""The compile runner: ``torch.compile`` of the whole model forward.

Attention is the opaque custom op ``pyxllm::attention`` (see ``pyxllm.layers.attention``), so
the decoder layers compile into one graph with no graph break. The token dimension is marked
*unbacked* dynamic on every call, so one graph serves every step, single-token ones included
(a plain dynamic size would be specialized, and recompiled, at 1); so are the rows of a GGUF
embedding kept as stored, which are looked up outside the graph (``StoredEmbedding``). On the
CPU, inductor emits C++ (gcc); SmolLM2-135M compiles in about 45 s on 2 cores with a cold
cache (inductor's disk cache, ``/tmp/torchinductor_<user>``, makes later starts quicker).

Inductor runs with ``emulate_precision_casts``: where eager rounds each op's bfloat16 (or
float16) output, a fused kernel would otherwise keep float32 between the ops it fuses, and
SmolLM2's greedy tokens in bfloat16 left eager's after a few steps; with the option it rounds
at the same places, so compile gives eager's tokens and logprobs, as every runner must.
"""

from __future__ import annotations

import torch
from torch import nn

from pyxllm.executor.runners.base import Runner


class CompileRunner(Runner):
    """``torch.compile(model)``, compiled on its first call; the eager runner's call signature.

    Args:
        model: the model (``forward(input_ids [T], positions [T]) -> [T, hidden]``).
        backend: the ``torch.compile`` backend (``inductor``).
    """

    name = "compile"

    def __init__(self, model: nn.Module, backend: str = "inductor") -> None:
        # lazy: dynamo takes ~2 s to import, and only this runner needs it
        from torch._dynamo.decorators import mark_unbacked

        super().__init__(model)
        for module in model.modules():  # a GGUF embedding looked up outside the graph
            lookup = getattr(module, "stored_lookup", None)
            if lookup is not None:
                lookup.mark_unbacked = mark_unbacked
        options = {"emulate_precision_casts": True} if backend == "inductor" else None
        self.compiled = torch.compile(model, backend=backend, dynamic=True, options=options)
        self.mark_unbacked = mark_unbacked

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.mark_unbacked(input_ids, 0)
        self.mark_unbacked(positions, positions.dim() - 1)  # [T], or mRoPE's [3, T]
        return self.compiled(input_ids, positions)
