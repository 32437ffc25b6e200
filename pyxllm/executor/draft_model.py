"""The draft model of ``--speculative-config '{"method": "draft_model", "model": PATH, ...}'``.

A second, small model with the target's vocabulary, run by the same executor with a KV cache of
its own. Its cache has the target's block count and block size and is addressed by the same
block tables and slots, so it needs no allocator: every step the draft first runs on the
step's real tokens (prefill chunks, each decoding sequence's last token), which keeps its cache
holding the same tokens as the target's (a prefix-cache hit finds the draft's K/V in the same
block), then proposes greedily, one token at a time for ``k`` steps batched over the drafting
sequences, writing its drafts' K/V into the slots the scheduler allocated for them (the last
draft is fed back too, so an accepted run leaves nothing to catch up on). Rejected
drafts' slots are rewritten with the right tokens later, as the target's are. The drafts are
one-hot proposals, verified as :mod:`pyxllm.executor.spec_decode` explains.

Under tensor parallelism the draft is split over the TP ranks as the target is (its layers
are the same parallel layers); rank 0 computes its logits and broadcasts the chosen tokens, so
every rank feeds the same drafts to the target.
"""

from __future__ import annotations

import dataclasses

import torch

from pyxllm.distributed.parallel_state import tensor_model_parallel_broadcast
from pyxllm.executor.input_batch import InputBatch
from pyxllm.executor.kv_cache import KVCacheSpec, allocate_kv_caches
from pyxllm.executor.runners import EagerRunner
from pyxllm.executor.scheduler_output import ScheduledSequence, SchedulerOutput
from pyxllm.layers.forward_context import ForwardContext
from pyxllm.models.build_context import build_model
from pyxllm.models.registry import resolve_model_class
from pyxllm.models.weight_loading import load_weights
from pyxllm.platforms.interface import load_class
from pyxllm.weights import iter_weight_slices, load_model_config, resolve_model_source


class DraftModel:
    """Proposes greedy drafts into a step's plan (the placeholders the scheduler reserved).

    Raises:
        ValueError: the draft's vocabulary differs from the target's (naming both sizes), or
            the draft cannot be loaded (see ``ModelExecutor``).
    """

    def __init__(self, path: str, target_config, executor) -> None:
        config = executor.config
        try:
            source = resolve_model_source(path, download_dir=config.download_dir)
        except (ValueError, FileNotFoundError) as exc:  # its text speaks of the served model
            raise ValueError(
                f"--speculative-config: the draft model {path!r} cannot be found: neither a path "
                "that exists nor a Hugging Face model id in the cache or on the Hub"
            ) from exc
        self.model_config = load_model_config(source)
        if self.model_config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"--speculative-config: the draft model {path} has a vocabulary of "
                f"{self.model_config.vocab_size} tokens, the target {target_config.vocab_size}; "
                "they must be the same"
            )
        self.block_size, self.device = config.block_size, executor.device
        model_cls = resolve_model_class(self.model_config, executor.platform.name)
        self.model = build_model(
            model_cls, self.model_config, self.device, executor.dtype, config.max_model_len
        )
        load_weights(self.model, iter_weight_slices(source, self.model_config))
        spec = KVCacheSpec.from_model(self.model, config.block_size, executor.dtype)
        self.kv_caches = allocate_kv_caches(
            spec, executor.num_kv_blocks, executor.platform, self.device
        )
        self.attn_backend = load_class(
            executor.platform.select_attention_backend(config.block_size)
        )()
        self.runner = EagerRunner(self.model)

    def _next_tokens(self, seqs: list[ScheduledSequence]) -> list[int]:
        """Run the draft over ``seqs``; its greedy next token for each sequence that samples."""
        batch = InputBatch.build(SchedulerOutput(seqs), self.block_size, self.device)
        hidden = self.runner.execute(
            batch, lambda b: ForwardContext(self.attn_backend.build(b), self.kv_caches)
        )
        if not len(batch.logits_indices):
            return []
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
        if logits is not None:  # TP rank 0 (or one process) has the logits; the others wait
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.empty(len(batch.logits_indices), dtype=torch.long, device=self.device)
        return tensor_model_parallel_broadcast(tokens).tolist()

    @torch.inference_mode()
    def propose(self, plan: SchedulerOutput) -> None:
        """Catch the draft's cache up with ``plan``'s real tokens and replace each sequence's
        ``num_draft_tokens`` placeholders with the draft's greedy continuation, in place."""
        real = [
            dataclasses.replace(
                s,
                token_ids=s.token_ids[: len(s.token_ids) - s.num_draft_tokens],
                num_draft_tokens=0,
                mrope_positions=None,  # the draft is a text model: 1-D positions
            )
            for s in plan.sequences
        ]
        firsts = self._next_tokens(real)
        sampled = [s for s in plan.sequences if s.sample]
        drafting = [(s, [t]) for s, t in zip(sampled, firsts) if s.num_draft_tokens]
        # draft j is fed back at position p + j; the last one too, so that the draft's cache
        # holds it when every draft is accepted (its next token is not used)
        for j in range(1, max((s.num_draft_tokens for s, _ in drafting), default=0) + 1):
            active = [(s, d) for s, d in drafting if s.num_draft_tokens >= j]
            steps = [
                dataclasses.replace(
                    s,
                    token_ids=[d[-1]],
                    num_computed_tokens=s.num_computed_tokens + j,
                    num_draft_tokens=0,
                    sample=True,
                    mrope_positions=None,
                )
                for s, d in active
            ]
            for (_, d), token in zip(active, self._next_tokens(steps)):
                d.append(token)
        for seq, drafts in drafting:
            k = seq.num_draft_tokens
            seq.token_ids[len(seq.token_ids) - k :] = drafts[:k]
