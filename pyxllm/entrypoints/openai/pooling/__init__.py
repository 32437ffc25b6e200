"""Pooling endpoints: embeddings (``/v1/embeddings``), score and rerank, ``/pooling``."""
