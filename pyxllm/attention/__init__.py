"""Attention backends: stateful, owned by the executor, built once per step from the input batch."""
