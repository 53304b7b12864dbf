"""User jobs written as people outside distopt write them, one folder each (a ``job.yaml`` and
the user's package), launched from a copy outside the repository by ``test_corpus.py``:

- ``kv_recsys``: tables in the user's own feature store on ``ps0``, reached with ``rpc_sync``
  (``ps_tables()`` is ``[]``); a map-style Dataset with columns ``user``, ``item``, ``shop``; also
  the job docs/own_job.md shows and ``test_own_job_doc.py`` runs;
- ``ps_stream``: distopt's own tables (``RemoteEmbedding``); an ``IterableDataset`` of events;
- ``rref_tables``: a ``RemoteModule`` on ``ps0``, as the RPC tutorials write it;
- ``ray_tables``: embedding shards as the user's Ray actors, pushed to from backward;
- ``pair_factory``: a model factory returning ``(model, example_inputs)``, synthetic data.
"""
