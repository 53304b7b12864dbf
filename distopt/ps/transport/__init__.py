"""How a trainer's requests reach the parameter servers, both ends of each transport.

``base``: the :class:`~distopt.ps.transport.base.Transport` a client sends through; ``rpc``:
``torch.distributed.rpc`` (the trainer's calls and the server process's handlers); ``ray``: the
trainer's calls to Ray actors; ``ray_actor``: the server as a Ray actor; ``ray_wire``: tensors
as NumPy arrays across Ray.
"""
