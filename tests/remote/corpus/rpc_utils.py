"""RRef helpers as the PyTorch RPC tutorials write them (parameter-server and RNN examples)."""

import torch.distributed.rpc as rpc


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


def _parameter_rrefs(module):
    param_rrefs = []
    for param in module.parameters():
        param_rrefs.append(rpc.RRef(param))
    return param_rrefs
