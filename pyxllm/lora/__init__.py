"""LoRA adapters served on one base model (``--enable-lora``): loading and checking a PEFT
adapter (:mod:`pyxllm.lora.adapter`) and batching adapters in one step
(:mod:`pyxllm.lora.manager`). The request type is :mod:`pyxllm.lora_request` (no torch)."""
