"""One parameter server, whatever carries its requests.

``parameter_server``: the server's shards and every operation it answers; ``operation``: how an
operation is declared (once, as a method) and what is derived from it; ``table``: one shard of one
table and its update math; ``shard_files``: the servers' files in a checkpoint and the record naming
a job's last one.
"""
