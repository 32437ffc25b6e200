"""The encoder step of a vision-language model: each image encoded once, its features cached.

vLLM v1's encoder cache is the model: a step's prefill chunks name the images whose
placeholder runs they overlap (``ScheduledSequence.mm_features``); images not in the cache
are encoded together, once (``model.embed_multimodal``, each of their encoder inputs
concatenated along dim 0), and kept under their content hash,
so a later chunk of the same prompt, a prompt recomputed after preemption or another request
with the same image reads them back. Each chunk takes the rows of its part of the run, which
replace the placeholder tokens' embeddings in the forward pass
(:class:`~pyxllm.layers.forward_context.MultiModalEmbeddings`). Least recently used entries
are dropped past a budget of feature rows; a dropped image is simply encoded again.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from pyxllm.layers.forward_context import MultiModalEmbeddings
from pyxllm.multimodal_inputs import MultiModalFeatureSpec

# feature rows kept (LLaVA-1.5: 576 per image, so about 14 images)
DEFAULT_CACHE_ROWS = 8192


class EncoderCache:
    """Encoder outputs by image content hash, least recently used dropped first.

    Args:
        model: has ``embed_multimodal(**data) -> [rows, hidden]``, ``data`` the images'
            encoder inputs (``pixel_values [N, 3, H, W]``; Qwen2-VL's patches and
            ``image_grid_thw``), the rows each image's placeholder run holds, in order.
        device: where the features are computed and kept.
        max_rows: feature rows kept; the images of the current step stay even past it.
    """

    def __init__(self, model, device: torch.device, max_rows: int = DEFAULT_CACHE_ROWS) -> None:
        self.model, self.device, self.max_rows = model, device, max_rows
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # images encoded so far (for tests and logs)

    def _encode(self, features: list[MultiModalFeatureSpec]) -> None:
        """Encode ``features`` (not cached, distinct) in one call and cache each one's rows.

        Raises:
            ValueError: the encoder made another number of rows than the placeholder runs
                hold (a processor and model that disagree).
        """
        inputs = {
            key: torch.cat([f.data[key] for f in features]).to(self.device)
            for key in features[0].data
        }
        out = self.model.embed_multimodal(**inputs)
        lengths = [f.mm_position.length for f in features]
        if out.shape[0] != sum(lengths):
            raise ValueError(
                f"the encoder made {out.shape[0]} feature rows for {len(features)} images whose "
                f"placeholder runs hold {sum(lengths)} tokens"
            )
        for feature, rows in zip(features, out.split(lengths)):
            self.entries[feature.identifier] = rows
        self.num_encoded += len(features)

    def step_embeddings(self, plan, query_start_list: list[int]) -> MultiModalEmbeddings | None:
        """The step's :class:`MultiModalEmbeddings` for ``plan`` (a ``SchedulerOutput``;
        ``query_start_list[i]``: where sequence ``i``'s tokens start in the step), encoding the
        images it needs that are not cached; ``None`` when no token is a placeholder."""
        needed = {
            f.identifier: f
            for seq in plan.sequences
            for f in seq.mm_features
            if f.identifier not in self.entries
        }
        if needed:
            self._encode(list(needed.values()))
        indices, embeds, used = [], [], set()
        for seq, base in zip(plan.sequences, query_start_list):
            start = seq.num_computed_tokens
            for f in seq.mm_features:
                part = f.overlap(start, start + len(seq.token_ids))
                if part is None:
                    continue
                lo, hi = part
                rows = self.entries[f.identifier]
                self.entries.move_to_end(f.identifier)
                used.add(f.identifier)
                offset = f.mm_position.offset
                embeds.append(rows[lo - offset : hi - offset])
                indices.append(torch.arange(base + lo - start, base + hi - start))
        self._evict(used)
        if not embeds:
            return None
        return MultiModalEmbeddings(
            torch.cat(indices).to(self.device, non_blocking=True), torch.cat(embeds)
        )

    def _evict(self, keep: set[str]) -> None:
        """Drop least recently used entries past :attr:`max_rows`, never those in ``keep``."""
        total = sum(rows.shape[0] for rows in self.entries.values())
        for key in list(self.entries):
            if total <= self.max_rows:
                break
            if key not in keep:
                total -= self.entries.pop(key).shape[0]
