"""Which LoRA adapter a request runs with (vLLM's ``LoRARequest``); no torch, so the API side
can build one."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter, named as vLLM names it.

    Attributes:
        lora_name: the name clients send as ``model`` (unique among the loaded adapters).
        lora_int_id: a positive integer unique among the loaded adapters (the engine's key).
        lora_path: the adapter's directory: PEFT's ``adapter_config.json`` and
            ``adapter_model.safetensors``.
        base_model_name: the served model it applies to (listed as its ``parent`` in
            ``/v1/models``); ``None``: the served model.

    Raises:
        ValueError: an empty name or path, or an id below 1 (naming the field).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name: must not be empty")
        if not self.lora_path:
            raise ValueError("lora_path: must not be empty")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be >= 1, got {self.lora_int_id}")

    @property
    def prefix_cache_salt(self) -> bytes:
        """What a prompt's first KV block hash chains from for this adapter, so that two
        adapters (or an adapter and the base model) never share cached KV: the adapter changes
        every layer's keys and values."""
        return hashlib.sha256(f"lora\0{self.lora_int_id}\0{self.lora_path}".encode()).digest()
