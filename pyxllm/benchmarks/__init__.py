"""Benchmarks: ``pyxllm bench serve`` (any OpenAI-compatible server), ``bench eval`` (GSM8K
through any OpenAI-compatible server), ``bench perplexity`` (perplexity and KL divergence,
offline ``LLM``), ``bench throughput`` (offline ``LLM``) and ``bench latency`` (batch 1); see
docs/performance.md (Tools) and docs/evaluation.md."""
