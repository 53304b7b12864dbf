"""The example inputs' values of a graph's nodes, computed on fake tensors while it is traced.

Symbolic tracing cannot branch on a traced value (transformers' ResNet checks
``if num_channels != self.num_channels``): it does not know the value. Given example inputs it
can: :class:`~distopt.capture.tracer.DistoptTracer` takes the branch the example takes and
guards it in the graph (docs/optimize.md, "Capture"). Values are computed on demand, on fake tensors (shapes
and dtypes, no data): tracing runs no kernel, changes none of the model's state and sends no
remote call. Without this, such a model went to Dynamo, whose trace of transformers' ResNet-50
took about a second of its optimize time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._symbolic_trace import _maybe_revert_all_patches
from torch.utils._pytree import tree_map_only

__all__ = ["ExampleValues", "NoExampleValue"]


class NoExampleValue(Exception):
    """A node whose value cannot be known without running it for real: a remote call, a
    value that depends on the data, an op fake tensors do not support."""


class ExampleValues:
    """Values of the nodes of ``graph`` (being traced from ``root``) on ``inputs``, the
    forward's positional example inputs.

    ``constants`` are the tracer's ``get_attr`` targets that are not attributes of ``root``
    (functions and handles it keeps aside); ``opaque`` names nodes that must not be evaluated
    (remote calls).
    """

    def __init__(
        self,
        root: nn.Module,
        graph: torch.fx.Graph,
        inputs: tuple[Any, ...],
        constants: Mapping[str, Any],
        opaque: set[torch.fx.Node],
    ) -> None:
        self._root = root
        self._graph = graph
        self._inputs = inputs
        self._constants = constants
        self._opaque = opaque
        # The model's state enters as fakes (get_attr, and leaf modules' state below); real
        # tensors a module keeps outside its state turn fake when an op meets them.
        self._mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._values: dict[torch.fx.Node, Any] = {}

    def of(self, node: torch.fx.Node) -> Any:
        """The value of ``node`` on the example inputs; :class:`NoExampleValue` when unknowable."""
        needed: set[torch.fx.Node] = set()
        stack = [node]
        while stack:
            current = stack.pop()
            if current in self._values or current in needed:
                continue
            if current in self._opaque:
                raise NoExampleValue(f"it depends on the remote call {current.name!r}")
            needed.add(current)
            stack.extend(current.all_input_nodes)
        # Graph order is an order in which every node's inputs come first.
        placeholders = 0
        for current in self._graph.nodes:
            if current.op == "placeholder":
                placeholders += 1
            if current in needed:
                self._values[current] = self._compute(current, placeholders - 1)
            if current is node:
                break
        return self._values[node]

    def _compute(self, node: torch.fx.Node, placeholder_index: int) -> Any:
        if node.op == "placeholder":
            return self._input(node, placeholder_index)
        if node.op == "get_attr":
            return self._attribute(str(node.target))
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), self._values.__getitem__)
        try:
            # The tracer's patches of nn.Module.__call__ and of wrapped functions would turn
            # these calls into graph nodes: they run as plain Python here.
            with _maybe_revert_all_patches(), self._mode:
                if node.op == "call_function":
                    return node.target(*args, **kwargs)  # type: ignore[operator]
                if node.op == "call_method":
                    self_value, *rest = args
                    return getattr(self_value, str(node.target))(*rest, **kwargs)
                if node.op == "call_module":
                    module = self._root.get_submodule(str(node.target))
                    # Its parameters and buffers swapped for fakes while it runs: batch norm's
                    # ``num_batches_tracked += 1`` would otherwise count on the real buffer.
                    state = {
                        name: self._fake(tensor)
                        for name, tensor in (*module.named_parameters(), *module.named_buffers())
                    }
                    return torch.func.functional_call(module, state, tuple(args), kwargs)
        except Exception as err:
            raise NoExampleValue(
                f"computing {node.name!r} on fake example inputs failed: {type(err).__name__}"
            ) from err
        raise NoExampleValue(f"node {node.name!r} ({node.op}) has no value")

    def _input(self, node: torch.fx.Node, index: int) -> Any:
        if str(node.target).startswith("*"):
            raise NoExampleValue(f"the variadic input {node.target!r} is not supported")
        if index < len(self._inputs):
            return self._fake(self._inputs[index])
        if node.args:  # the forward's default for an input the example leaves out
            return self._fake(node.args[0])
        raise NoExampleValue(f"the example inputs give no value for {node.target!r}")

    def _attribute(self, target: str) -> Any:
        if target in self._constants:
            return self._constants[target]
        value: Any = self._root
        for part in target.split("."):
            value = getattr(value, part)
        return self._fake(value)

    def _fake(self, value: Any) -> Any:
        return tree_map_only(torch.Tensor, self._mode.from_tensor, value)
