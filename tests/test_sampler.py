"""The batched sampler on hand-made logits, against references written here in plain torch."""
from __future__ import annotations

import torch

from pyxllm.executor.sampler import Sampler, SamplingMetadata, apply_top_k_top_p
from pyxllm.executor.scheduler_output import ScheduledSequence
from pyxllm.sampling_params import SamplingParams


def _seqs(*params: SamplingParams) -> list[ScheduledSequence]:
    return [
        ScheduledSequence(str(i), [0], 0, [0], True, p, torch.Generator().manual_seed(p.seed) if p.seed is not None else None)
        for i, p in enumerate(params)
    ]


def _kept_reference(row: torch.Tensor, k: int, p: float) -> set[int]:
    order = sorted(range(len(row)), key=lambda i: -float(row[i]))[:k]
    probs = torch.softmax(row[order], dim=-1)
    kept, mass = [], 0.0
    for idx, prob in zip(order, probs.tolist()):
        if mass >= p:
            break
        kept.append(idx)
        mass += prob
    return set(kept)


def test_top_k_top_p_keep_the_reference_sets():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    top_k = torch.tensor([1, 5, 50, 10, 50, 3])
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.9, 0.05, 0.7])
    masked = apply_top_k_top_p(logits.clone(), top_k, top_p)
    for row in range(6):
        kept = set(torch.nonzero(masked[row] > float("-inf")).flatten().tolist())
        assert kept == _kept_reference(logits[row], int(top_k[row]), float(top_p[row]))
        assert torch.equal(masked[row][list(kept)], logits[row][list(kept)])


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(3, 100)
    params = (SamplingParams(temperature=0), SamplingParams(temperature=1.5), SamplingParams(temperature=0))
    seqs = _seqs(*params)
    tokens = Sampler(seed=1)(logits, SamplingMetadata.build(seqs, 100, torch.device("cpu")))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_seeded_request_samples_the_same_alone_and_in_a_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler(seed=0)(logits[2:3], SamplingMetadata.build(_seqs(seeded), 1000, torch.device("cpu")))
    batch = _seqs(SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5), seeded, SamplingParams(temperature=0))
    together = Sampler(seed=99)(logits, SamplingMetadata.build(batch, 1000, torch.device("cpu")))
    assert together[2] == alone[0]


def test_sampling_follows_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    seqs = _seqs(*[SamplingParams(temperature=2.0)] * 4000)
    tokens = Sampler(seed=0)(logits, SamplingMetadata.build(seqs, 4, torch.device("cpu")))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    expected = torch.softmax(logits[0] / 2.0, dim=-1)
    assert torch.allclose(freq, expected, atol=0.03)


def test_top_k_one_is_greedy_whatever_the_temperature():
    logits = torch.randn(8, 64)
    seqs = _seqs(*[SamplingParams(temperature=5.0, top_k=1)] * 8)
    tokens = Sampler(seed=3)(logits, SamplingMetadata.build(seqs, 64, torch.device("cpu")))
    assert torch.equal(tokens, logits.argmax(dim=-1))
