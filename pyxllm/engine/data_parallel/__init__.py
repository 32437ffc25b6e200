"""Data parallelism (``--data-parallel-size N``): N whole engine replicas behind one API server.

Each replica is its own process (with Ray, an actor on the cluster) with its own scheduler, KV
cache and TP group of ``--tp`` ranks; the replicas know nothing of each other. The API server
tokenizes and validates every request once, and a router, not an engine, decides which replica
runs it:

- :mod:`.router`: the routing policies (``--dp-routing``) and the approximate prefix index
  behind ``cache_aware``;
- :mod:`.client`: :class:`DataParallelEngine`, the handlers' engine, which sends requests to
  replicas and streams their outputs back, and watches for replicas that die;
- :mod:`.replica`: a replica's process (:func:`~.replica.run_replica`);
- :mod:`.launcher`: where replicas run (``mp``: processes on this host, the CPU cores divided
  between them); :mod:`.ray_launcher`: ``ray``, actors placed on the Ray cluster;
- :mod:`.wire`: the messages on the channel between the server and a replica;
- :mod:`.metrics`: ``/metrics`` and ``/debug/stats`` per replica and in total.

Nothing is imported here, so that the router loads without torch.
"""
