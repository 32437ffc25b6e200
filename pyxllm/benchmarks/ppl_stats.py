"""Perplexity and KL-divergence statistics of scored tokens, as llama.cpp's ``perplexity`` tool
computes and prints them (``tools/perplexity/perplexity.cpp``: ``perplexity`` for the
perplexity, ``kl_divergence`` for ``--kl-divergence``).

Each window contributes the rows of its scored tokens: the evaluated model's log-softmax ``q``
and, for KL, the base model's ``b`` (natural logs over the whole vocabulary,
``float32 [tokens, vocab]``), with the tokens that follow (``int64 [tokens]``). Per token:

- ``NLL = -q[target]``; perplexity ``PPL = exp(mean NLL)`` with uncertainty ``PPL * s``,
  ``s = sqrt((mean(NLL^2) - mean(NLL)^2) / (n - 1))`` (llama.cpp's ``mean_and_uncertainty``,
  which gives 0 for ``n <= 10``);
- ``KLD = sum_v exp(b_v) * (b_v - q_v)``, KL(base || evaluated) in nats. llama.cpp reads the
  base rows back from a file of uint16-quantized logprobs and drops the terms with
  ``b_v < -16``; here both rows are exact float32, so the same model against itself gives 0;
- ``dp = exp(-NLL) - exp(-NLL_base)``, the change of the target token's probability;
- same top token: ``argmax q == argmax b``.

Only the per-token KLD and dp values are kept (for the percentiles), never the rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def mean_and_uncertainty(total: float, total_sq: float, count: int) -> tuple[float, float]:
    """``(mean, standard error of the mean)`` from ``count`` values' sum and sum of squares
    (llama.cpp's ``mean_and_uncertainty``: the error is 0 for ``count <= 10``)."""
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = total_sq / count - mean * mean
    return mean, math.sqrt(var / (count - 1)) if var > 0 and count > 10 else 0.0


def covariance(total_a: float, total_b: float, total_ab: float, count: int) -> float:
    """The covariance of two means from the values' sums and the sum of their products
    (llama.cpp's ``covariance``: 0 for ``count < 10``)."""
    if count < 10:
        return 0.0
    return (total_ab / count - (total_a / count) * (total_b / count)) / (count - 1)


def percentile(ordered: torch.Tensor, fraction: float) -> float:
    """The ``fraction`` quantile of the ascending ``ordered`` values, interpolated linearly
    between neighbours (llama.cpp's ``percentile``; 0.5 is the median)."""
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    weight = position - low
    return (1 - weight) * ordered[low].item() + weight * ordered[high].item()


@dataclass(slots=True)
class Moments:
    """Running count, sum and sum of squares of one per-token quantity (float64 sums)."""

    count: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    def add(self, values: torch.Tensor) -> None:
        values = values.double()
        self.count += values.numel()
        self.total += values.sum().item()
        self.total_sq += values.square().sum().item()

    def mean_and_uncertainty(self) -> tuple[float, float]:
        return mean_and_uncertainty(self.total, self.total_sq, self.count)


def token_nll(rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``float32 [tokens]``: ``-rows[i, targets[i]]``, each target's negative log-likelihood."""
    return -rows.gather(1, targets.unsqueeze(1)).squeeze(1)


@dataclass(slots=True)
class Perplexity:
    """The perplexity of the tokens scored so far."""

    nll: Moments = field(default_factory=Moments)

    def add_window(self, rows: torch.Tensor, targets: torch.Tensor) -> None:
        """Score one window's ``rows`` (``float32 [tokens, vocab]`` log-softmax) at ``targets``."""
        self.nll.add(token_nll(rows, targets))

    def value(self) -> tuple[float, float]:
        """``(PPL, its uncertainty)``."""
        mean, error = self.nll.mean_and_uncertainty()
        ppl = math.exp(mean)
        return ppl, ppl * error


@dataclass(slots=True)
class KLDivergence:
    """The evaluated model against the base one on the tokens scored so far (the sums of
    llama.cpp's ``kl_divergence_result``, and each token's KLD and dp)."""

    nll: Moments = field(default_factory=Moments)
    nll_base: Moments = field(default_factory=Moments)
    nll_cross: float = 0.0  # sum of NLL * NLL_base
    kld: Moments = field(default_factory=Moments)
    p_diff: Moments = field(default_factory=Moments)
    p_diff_sq: Moments = field(default_factory=Moments)  # of dp^2: sums of dp^2 and dp^4
    same_top: int = 0
    kld_values: list[torch.Tensor] = field(default_factory=list)
    p_diff_values: list[torch.Tensor] = field(default_factory=list)

    def add_window(self, rows: torch.Tensor, base: torch.Tensor, targets: torch.Tensor) -> None:
        """Add one window: the evaluated ``rows`` and the ``base`` rows (``float32 [tokens,
        vocab]`` log-softmax each) of the same positions, scored at ``targets``."""
        nll, nll_base = token_nll(rows, targets), token_nll(base, targets)
        kld = (base.exp() * (base - rows)).sum(dim=-1)
        p_diff = torch.exp(-nll) - torch.exp(-nll_base)
        self.nll.add(nll)
        self.nll_base.add(nll_base)
        self.nll_cross += (nll.double() * nll_base.double()).sum().item()
        self.kld.add(kld)
        self.p_diff.add(p_diff)
        self.p_diff_sq.add(p_diff.square())
        self.same_top += int((rows.argmax(dim=-1) == base.argmax(dim=-1)).sum())
        self.kld_values.append(kld)
        self.p_diff_values.append(p_diff)

    @property
    def count(self) -> int:
        return self.nll.count

    def log_ppl_ratio(self) -> tuple[float, float]:
        """``ln(PPL(Q) / PPL(base))`` and its uncertainty (the two means are correlated)."""
        (q, q_err), (b, b_err) = (
            self.nll.mean_and_uncertainty(),
            self.nll_base.mean_and_uncertainty(),
        )
        cov = self._log_ppl_cov()
        return q - b, math.sqrt(max(q_err * q_err + b_err * b_err - 2 * cov, 0.0))

    def _log_ppl_cov(self) -> float:
        return covariance(self.nll.total, self.nll_base.total, self.nll_cross, self.count)

    def p_diff_rms(self) -> tuple[float, float]:
        """The root mean square of dp and its uncertainty."""
        mse, mse_err = self.p_diff_sq.mean_and_uncertainty()
        rms = math.sqrt(mse)
        return rms, 0.5 / rms * mse_err if rms > 0 else 0.0

    def same_top_rate(self) -> tuple[float, float]:
        """The fraction of tokens whose most likely next token is the base's, and its binomial
        uncertainty."""
        rate = self.same_top / self.count
        return rate, math.sqrt(rate * (1 - rate) / (self.count - 1)) if self.count > 1 else 0.0

    def summary(self) -> dict[str, float]:
        """The final figures, as llama.cpp's three blocks print them (PPL values in their
        units, KLD in nats, dp and the same-top rate as fractions)."""
        (q, q_err), (b, b_err) = (
            self.nll.mean_and_uncertainty(),
            self.nll_base.mean_and_uncertainty(),
        )
        ppl, ppl_base = math.exp(q), math.exp(b)
        cov = self._log_ppl_cov()
        ratio, ratio_err = self.log_ppl_ratio()
        ppl_err, base_err = ppl * q_err, ppl_base * b_err
        kld = torch.cat(self.kld_values).sort().values
        p_diff = torch.cat(self.p_diff_values).sort().values
        out = {
            "ppl": ppl,
            "ppl_unc": ppl_err,
            "ppl_base": ppl_base,
            "ppl_base_unc": base_err,
            "ln_ppl_cor": cov / (q_err * b_err) if q_err * b_err > 0 else 0.0,
            "ln_ppl_ratio": ratio,
            "ln_ppl_ratio_unc": ratio_err,
            "ppl_ratio": math.exp(ratio),
            "ppl_ratio_unc": math.exp(ratio) * ratio_err,
            "ppl_diff": ppl - ppl_base,
            "ppl_diff_unc": math.sqrt(
                max(ppl_err**2 + base_err**2 - 2 * ppl * ppl_base * cov, 0.0)
            ),
        }
        out["kld_mean"], out["kld_unc"] = self.kld.mean_and_uncertainty()
        out |= {f"kld_{name}": percentile(kld, f) for name, f, _ in QUANTILES}
        out["p_diff_mean"], out["p_diff_unc"] = self.p_diff.mean_and_uncertainty()
        out |= {f"p_diff_{name}": percentile(p_diff, f) for name, f, _ in QUANTILES}
        out["p_diff_rms"], out["p_diff_rms_unc"] = self.p_diff_rms()
        out["same_top"], out["same_top_unc"] = self.same_top_rate()
        return out


# The quantiles llama.cpp prints, highest first: (key, fraction, row label).
QUANTILES = (
    ("max", 1.0, "Maximum"),
    ("p99.9", 0.999, "99.9%"),
    ("p99", 0.99, "99.0%"),
    ("p95", 0.95, "95.0%"),
    ("p90", 0.90, "90.0%"),
    ("median", 0.5, "Median"),
    ("p10", 0.10, "10.0%"),
    ("p5", 0.05, " 5.0%"),
    ("p1", 0.01, " 1.0%"),
    ("p0.1", 0.001, " 0.1%"),
    ("min", 0.0, "Minimum"),
)

KL_HEADER = (
    "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
    "              Δp RMS            Same top p"
)


def kl_chunk_line(chunk: int, kl: KLDivergence) -> str:
    """The running line llama.cpp prints after each chunk (1-based ``chunk``) under
    :data:`KL_HEADER`."""
    mean, error = kl.nll.mean_and_uncertainty()
    ppl = math.exp(mean)
    ratio, ratio_err = kl.log_ppl_ratio()
    kld, kld_err = kl.kld.mean_and_uncertainty()
    rms, rms_err = kl.p_diff_rms()
    top, top_err = kl.same_top_rate()
    return (
        f"{chunk:4d}    {ppl:9.4f} ± {ppl * error:9.4f}    {ratio:10.5f} ± {ratio_err:10.5f}"
        f"    {kld:10.5f} ± {kld_err:10.5f}    {100 * rms:6.3f} ± {100 * rms_err:6.3f} %"
        f"    {100 * top:6.3f} ± {100 * top_err:6.3f} %"
    )


def format_kl_report(s: dict[str, float]) -> str:
    """llama.cpp's final blocks (perplexity, KL divergence, token probability statistics) from
    :meth:`KLDivergence.summary`."""
    lines = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s['ppl']:10.6f} ± {s['ppl_unc']:10.6f}",
        f"Mean PPL(base)                : {s['ppl_base']:10.6f} ± {s['ppl_base_unc']:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['ln_ppl_cor']:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio']:10.6f} ± "
        f"{s['ln_ppl_ratio_unc']:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio']:10.6f} ± {s['ppl_ratio_unc']:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {s['ppl_diff']:10.6f} ± {s['ppl_diff_unc']:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {s['kld_mean']:10.6f} ± {s['kld_unc']:10.6f}",
        *(f"{label:7} KLD: {s[f'kld_{name}']:10.6f}" for name, _, label in QUANTILES),
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {100 * s['p_diff_mean']:6.3f} ± {100 * s['p_diff_unc']:5.3f} %",
        *(f"{label:7} Δp: {100 * s[f'p_diff_{name}']:6.3f}%" for name, _, label in QUANTILES),
        f"RMS Δp    : {100 * s['p_diff_rms']:6.3f} ± {100 * s['p_diff_rms_unc']:5.3f} %",
        f"Same top p: {100 * s['same_top']:6.3f} ± {100 * s['same_top_unc']:5.3f} %",
    ]
    return "\n".join(lines)
