"""How an embedding model pools and normalizes, from sentence-transformers' files in its
directory: ``modules.json`` lists the modules (a ``Pooling`` module's directory holds
``config.json`` with its ``pooling_mode_*``; a ``Normalize`` module means L2 normalization),
``sentence_bert_config.json`` gives ``max_seq_length``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pyxllm.weights.errors import ModelLoadError

# sentence-transformers' pooling modes -> vLLM's pooling types (the ones pyxllm computes)
_MODES = {
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_lasttoken": "LAST",
}


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """One embedding model's pooling.

    Attributes:
        pooling_type: ``"MEAN"`` (over the sequence's tokens), ``"CLS"`` (its first token) or
            ``"LAST"`` (its last token).
        normalize: whether the vector is L2-normalized.
        max_seq_length: sentence-transformers' ``max_seq_length`` (tokens it embeds at most),
            ``None`` when not given.
    """

    pooling_type: str
    normalize: bool
    max_seq_length: int | None = None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"{path} could not be read as JSON ({exc}); fix or delete it."
        ) from exc


def load_pooling_config(directory: Path | None, default_type: str) -> PoolingConfig:
    """The pooling of the model in ``directory`` (``None``: a GGUF file, which has none):
    sentence-transformers' modules when ``modules.json`` is there, else ``default_type``
    (``"CLS"`` for an encoder, ``"LAST"`` for a decoder, as vLLM does) with normalization.

    Raises:
        ModelLoadError: an unreadable JSON file, or a pooling mode pyxllm does not compute
            (``max``, ``mean_sqrt_len``, ``weightedmean``), naming the file.
    """
    if directory is None or not (directory / "modules.json").is_file():
        return PoolingConfig(default_type, True)
    modules = _read_json(directory / "modules.json")
    pooling_type, normalize = default_type, False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            path = directory / str(module.get("path", "")) / "config.json"
            modes = [k for k, v in _read_json(path).items() if k.startswith("pooling_mode") and v]
            unknown = [m for m in modes if m not in _MODES]
            if unknown or len(modes) != 1:
                raise ModelLoadError(
                    f"{path}: pyxllm pools by exactly one of {', '.join(_MODES)}, got "
                    f"{', '.join(modes) or 'none'}"
                )
            pooling_type = _MODES[modes[0]]
    bert = directory / "sentence_bert_config.json"
    max_len = _read_json(bert).get("max_seq_length") if bert.is_file() else None
    return PoolingConfig(pooling_type, normalize, max_len if isinstance(max_len, int) else None)
