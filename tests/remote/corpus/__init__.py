"""Parameter-server models written the way other people write them, one idiom per module.

The styles come from PyTorch's own RPC tutorials and examples (the parameter-server tutorial's
``_remote_method`` helpers, the RNN model-parallel example, the DDP+RPC example's
``RemoteModule``, the RRef proxy API) and from code users write by name (``rpc_sync("ps0",
lookup, ...)``). No model calls a distopt API. Each module has:

* ``Model`` — blocking remote calls written right before their use;
* ``HandAsync`` — the same model (same parameter names, same arithmetic) written asynchronously
  by hand: every call issued first, each waited right before its use (the practical ideal);
* ``build(seed, hand=False)`` — the model with its two remote tables created on ``ps0``/``ps1``
  (seeded, so two builds with one seed hold equal tables);
* ``remote_parameters(model)`` — RRefs of the tables' parameters, for ``DistributedOptimizer``.

Server-side code lives in :mod:`tests.remote.corpus.tables`; ``server.py`` is the worker process
and ``group.py`` forms the RPC group (this process + the workers) on 127.0.0.1.
"""
