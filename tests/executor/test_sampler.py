"""The batched sampler on hand-made logits, against references written here in plain torch."""

from __future__ import annotations

import itertools

import pytest
import torch

from pyxllm.executor.logits_processors import _top_k_top_p_sorted
from pyxllm.executor.sampler import (
    Sampler,
    SamplingMetadata,
    apply_top_k_top_p,
    argmax_rows,
    exponential_draws,
)
from pyxllm.executor.scheduler_output import ScheduledSequence
from pyxllm.sampling_params import SamplingParams


def _seqs(*params: SamplingParams) -> list[ScheduledSequence]:
    return [
        ScheduledSequence(
            str(i),
            [0],
            0,
            [0],
            True,
            p,
            torch.Generator().manual_seed(p.seed) if p.seed is not None else None,
        )
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


@pytest.mark.parametrize("band", [0.5, 8.0])
def test_top_k_top_p_within_a_band_keep_the_reference_sets(band):
    """Peaked rows whose sets lie within the first band, flat rows whose nucleus reaches past
    it (wider bands, then a full sort), top-k alone, and rows that keep everything beside rows
    that do not; and the same sets from the whole-row sort that accelerators run."""
    torch.manual_seed(1)
    vocab = 3000
    logits = torch.randn(7, vocab)
    logits[:4] *= 8  # peaked: a few tokens hold most of the mass
    top_k = torch.tensor([vocab, 40, vocab, vocab, vocab, 300, vocab])
    top_p = torch.tensor([0.9, 0.95, 0.5, 1.0, 0.9, 0.8, 1.0])
    for (k, p), masked in itertools.chain.from_iterable(
        [
            (case, apply_top_k_top_p(logits.clone(), *case, band=band)),
            (case, _top_k_top_p_sorted(logits.clone(), *case)),  # an accelerator's path
        ]
        for case in ((top_k, top_p), (None, top_p), (top_k, None))
    ):
        for row in range(7):
            kept = set(torch.nonzero(masked[row] > float("-inf")).flatten().tolist())
            row_k = vocab if k is None else int(k[row])
            row_p = 1.0 if p is None else float(p[row])
            if row_k == vocab and row_p == 1.0:  # nothing to cut
                assert torch.equal(masked[row], logits[row])
                continue
            assert kept == _kept_reference(logits[row], row_k, row_p), (row, k is None)
            assert torch.equal(masked[row][list(kept)], logits[row][list(kept)])


def test_exponential_draws_follow_exp_1_and_replay_from_a_seed():
    """Exp(1)'s quantiles -log(1 - p) within 2 % over 200k draws, and one seed's draws again."""
    draws = exponential_draws((8, 50_000), torch.Generator().manual_seed(3))
    assert draws.dtype == torch.float32 and bool((draws >= 0).all())
    levels = torch.tensor([0.1, 0.5, 0.9, 0.99])
    expected = -torch.log1p(-levels)
    got = torch.quantile(draws.flatten()[:200_000], levels)
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.0)
    assert abs(draws.mean().item() - 1.0) < 0.01
    again = exponential_draws((8, 50_000), torch.Generator().manual_seed(3))
    assert torch.equal(draws, again)


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(3, 100)
    params = (
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=0),
    )
    seqs = _seqs(*params)
    tokens = Sampler(seed=1)(logits, SamplingMetadata.build(seqs, 100, torch.device("cpu")))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_seeded_request_samples_the_same_alone_and_in_a_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler(seed=0)(
        logits[2:3], SamplingMetadata.build(_seqs(seeded), 1000, torch.device("cpu"))
    )
    batch = _seqs(
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=5),
        seeded,
        SamplingParams(temperature=0),
    )
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


# --- penalties, biases, min_p, min_tokens and logprobs, each against a plain-torch reference ---

CPU = torch.device("cpu")


def _seq(params: SamplingParams, **fields) -> ScheduledSequence:
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return ScheduledSequence("r", [0], 0, [0], True, params, gen, **fields)


def _processed_logprobs(
    logits: torch.Tensor, seqs: list[ScheduledSequence]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``logits`` and return (token ids, every row's full logprobs rebuilt from its
    top-V)."""
    vocab = logits.shape[1]
    out = Sampler(seed=0).sample(logits.clone(), SamplingMetadata.build(seqs, vocab, CPU))
    full = torch.full((len(seqs), vocab), float("nan"))
    full.scatter_(1, out.logprobs.token_ids, out.logprobs.logprobs)
    return out.token_ids, full


def _penalized_reference(
    row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams
) -> torch.Tensor:
    row = row.clone()
    for t in set(prompt) | set(output):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row


def test_penalties_match_the_reference():
    torch.manual_seed(0)
    vocab = 20
    logits = torch.randn(4, vocab) * 2
    cases = [
        (
            SamplingParams(temperature=0, repetition_penalty=1.7, logprobs=vocab),
            [1, 2, 3],
            [3, 4, 4],
        ),
        (SamplingParams(temperature=0, presence_penalty=1.5, logprobs=vocab), [5, 6], [6, 7, 7, 7]),
        (
            SamplingParams(
                temperature=0,
                frequency_penalty=-0.8,
                presence_penalty=0.3,
                repetition_penalty=0.6,
                logprobs=vocab,
            ),
            [8, 9, 0],
            [0, 0, 11, 12, 11],
        ),
        (SamplingParams(temperature=0, logprobs=vocab), [1, 2], [1]),  # no penalty: untouched
    ]
    seqs = [
        _seq(p, penalty_token_ids=pr + out if p.uses_penalties else None, num_prompt_tokens=len(pr))
        for p, pr, out in cases
    ]
    tokens, got = _processed_logprobs(logits, seqs)
    for row, (p, prompt, output) in enumerate(cases):
        expected = _penalized_reference(logits[row], prompt, output, p)
        assert torch.allclose(got[row], torch.log_softmax(expected, dim=-1), atol=1e-5)
        assert tokens[row] == expected.argmax()


def test_presence_and_frequency_ignore_the_prompt():
    logits = torch.zeros(1, 8)
    logits[0, 2] = 1.0
    seq = _seq(
        SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0),
        penalty_token_ids=[2, 2, 2],
        num_prompt_tokens=3,
    )
    assert Sampler()(logits.clone(), SamplingMetadata.build([seq], 8, CPU)).item() == 2


def test_logit_bias_matches_the_reference():
    torch.manual_seed(1)
    logits = torch.randn(3, 16)
    biases = [{3: 100.0}, {0: -100.0, 5: 2.5, 15: -1.0}, None]
    seqs = [_seq(SamplingParams(temperature=0, logit_bias=b, logprobs=16)) for b in biases]
    tokens, got = _processed_logprobs(logits, seqs)
    for row, bias in enumerate(biases):
        expected = logits[row].clone()
        for t, v in (bias or {}).items():
            expected[t] += v
        assert torch.allclose(got[row], torch.log_softmax(expected, dim=-1), atol=1e-5)
        assert tokens[row] == expected.argmax()
    assert tokens[0] == 3


def test_min_tokens_masks_every_stop_id_until_reached():
    vocab, eos = 12, (4, 7, 9)
    logits = torch.zeros(3, vocab)
    logits[:, list(eos)] = 10.0  # the stop ids are by far the most likely
    params = SamplingParams(temperature=0, min_tokens=3, logprobs=vocab)
    seqs = [
        _seq(params, num_output_tokens=0, min_tokens_stop_ids=eos),
        _seq(params, num_output_tokens=2, min_tokens_stop_ids=eos),
        _seq(params, num_output_tokens=3),
    ]  # reached: the scheduler passes no ids
    tokens, got = _processed_logprobs(logits, seqs)
    for row in (0, 1):
        assert tokens[row] not in eos
        assert torch.isinf(got[row, list(eos)]).all()
        expected = logits[row].clone()
        expected[list(eos)] = float("-inf")
        assert torch.allclose(got[row], torch.log_softmax(expected, dim=-1))
    assert tokens[2] in eos


def test_min_p_top_k_top_p_together_match_the_reference():
    torch.manual_seed(2)
    vocab = 20
    logits = torch.randn(4, vocab) * 3
    settings = [
        dict(temperature=0.7, min_p=0.1),
        dict(temperature=1.3, top_k=6, top_p=0.8),
        dict(temperature=0.9, min_p=0.05, top_k=10, top_p=0.9),
        dict(temperature=1.0),
    ]
    seqs = [_seq(SamplingParams(logprobs=vocab, seed=i, **s)) for i, s in enumerate(settings)]
    tokens, got = _processed_logprobs(logits, seqs)
    for row, s in enumerate(settings):
        scaled = logits[row] / s["temperature"]
        probs = torch.softmax(scaled, dim=-1)
        keep = probs >= s.get("min_p", 0.0) * probs.max()
        # top-k then top-p over the tokens min-p kept, most likely first
        order = sorted((i for i in range(vocab) if keep[i]), key=lambda i: -float(scaled[i]))[
            : s.get("top_k", vocab)
        ]
        order_probs = torch.softmax(scaled[order], dim=-1).tolist()
        ref = {order[j] for j in range(len(order)) if sum(order_probs[:j]) < s.get("top_p", 1.0)}
        expected = torch.full((vocab,), float("-inf"))
        expected[list(ref)] = scaled[list(ref)]
        assert torch.allclose(got[row], torch.log_softmax(expected, dim=-1), atol=1e-5)
        assert int(tokens[row]) in ref


def test_logprobs_rank_and_top_k_of_the_sampled_distribution():
    torch.manual_seed(3)
    logits = torch.randn(2, 50)
    seqs = [
        _seq(SamplingParams(temperature=0.5, seed=7, logprobs=4)),
        _seq(SamplingParams(temperature=0, logprobs=0)),
    ]
    out = Sampler(seed=0).sample(logits.clone(), SamplingMetadata.build(seqs, 50, CPU))
    lp = torch.log_softmax(logits[0] / 0.5, dim=-1)
    (ids0, vals0, rank0), (ids1, vals1, rank1) = out.logprobs.tolists()
    assert ids0[0] == out.token_ids[0] and abs(vals0[0] - lp[ids0[0]]) < 1e-5
    assert rank0 == int((lp > lp[ids0[0]]).sum()) + 1
    assert ids0[1:] == lp.topk(4).indices.tolist()
    assert rank1 == 1 and ids1[0] == logits[1].argmax()  # greedy: rank 1, logprob at T=1
    assert abs(vals1[0] - torch.log_softmax(logits[1], dim=-1).max()) < 1e-5


def test_plain_greedy_batch_builds_no_optional_tensors():
    meta = SamplingMetadata.build(
        _seqs(SamplingParams(temperature=0), SamplingParams(temperature=0)), 100, CPU
    )
    assert meta.all_greedy
    assert (
        meta.greedy,
        meta.temperature,
        meta.top_p,
        meta.top_k,
        meta.min_p,
        meta.logit_bias,
        meta.min_tokens_mask,
        meta.penalties,
        meta.logprob_rows,
    ) == (None,) * 9
    assert Sampler().sample(torch.randn(2, 100), meta).logprobs is None


def test_sampling_params_validation_names_the_field():
    import pytest

    for kwargs, field in [
        (dict(n=0), "n"),
        (dict(top_p=0), "top_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logit_bias={"5": 101}), "logit_bias"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=21), "logprobs"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            SamplingParams(**kwargs)
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1.0}


def test_a_greedy_rows_logprobs_do_not_depend_on_a_neighbours_top_p():
    """A greedy row's log-probabilities are those of its own logits: a neighbour sampling with
    top-p or min-p (whose masks the batch computes for every row) changes none of their bits."""
    torch.manual_seed(4)
    vocab = 49152  # SmolLM2's (the batch's top-p cut, at 1 for a greedy row, trimmed its tail)
    logits = torch.randn(2, vocab)
    greedy = SamplingParams(temperature=0, logprobs=3)
    alone = Sampler(seed=0).sample(
        logits[:1].clone(), SamplingMetadata.build([_seq(greedy)], vocab, CPU)
    )
    for neighbour in (
        SamplingParams(temperature=0.8, top_p=0.5, seed=1),
        SamplingParams(temperature=0.8, min_p=0.2, top_k=7, seed=1),
    ):
        meta = SamplingMetadata.build([_seq(greedy), _seq(neighbour)], vocab, CPU)
        together = Sampler(seed=0).sample(logits.clone(), meta)
        assert together.logprobs.tolists()[0] == alone.logprobs.tolists()[0]


def test_argmax_rows_picks_what_torch_picks_on_ties_nan_and_masked_rows():
    logits = torch.randn(6, 257)
    logits[1, [3, 200]] = 50.0  # a tie: the first
    logits[2, 7] = float("nan")  # a NaN counts as the maximum
    logits[3] = float("-inf")  # a row masked out entirely: index 0
    logits[4, 10:] = float("-inf")
    for x in (logits, logits[:, 1:], logits[:0], logits.double()):  # strided, empty, float64
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(logits).dtype == torch.int64
    assert torch.equal(argmax_rows(logits.bfloat16()), logits.bfloat16().argmax(dim=-1))
