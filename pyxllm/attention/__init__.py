"""Attention backends: stateful, owned by the executor, built once per step from the input batch
(the protocols: :mod:`pyxllm.attention.abstract`)."""
