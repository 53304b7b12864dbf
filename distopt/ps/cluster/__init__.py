"""The life of a parameter-server job: start, join, leave, abort, stop, recover.

``session``: this process's part in jobs and the public lifecycle functions; ``lifecycle``: the
interface each ``ps.backend`` implements; ``rpc_backend`` and ``rpc_process``: server processes in
one RPC group (``rpc_main``: the command such a process runs); ``ray_backend``, ``ray_placement``
and ``ray_recovery``: server actors on a Ray cluster, where they run, and going on after Ray
restarted one (they import Ray: ``session`` loads them only for ``ps.backend: ray`` jobs);
``job``: the plain data a job's members share; ``admin``: calls that address whole servers
(checkpoints, statistics, latency).
"""
