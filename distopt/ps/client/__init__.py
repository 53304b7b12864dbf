"""The trainer side of the parameter servers: the calls model code makes.

``calls``: fetch, push, wait, flush and the :class:`~distopt.ps.client.calls.Client` behind them;
``ordering``: what each new request waits for; ``futures``: the futures requests return;
``context``: the rows fetched in this thread's step; ``embedding``: ``RemoteEmbedding``;
``cache``: the trainer's row caches (``ps.cache``);
``registration``: fetch and push declared to ``distopt.remote`` for the graph passes.
"""
