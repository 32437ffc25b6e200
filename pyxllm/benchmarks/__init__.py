"""Benchmarks: ``pyxllm bench serve`` (any OpenAI-compatible server), ``bench throughput``
(offline ``LLM``) and ``bench latency`` (batch 1); see README, Performance."""
