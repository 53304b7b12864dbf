"""Turn a partitioned GraphModule into one submodule per unit, keeping the original FQNs.

FSDP1 wraps modules and ``torch.compile`` compiles them, so units must exist as modules that the
forward actually calls. :func:`materialize_units` splits the graph with
``torch.fx.passes.split_module`` (``submod_0``, ``submod_1``, … called in order by the root) and
installs ``state_dict`` / ``load_state_dict`` hooks so checkpoints keep the original model's keys,
in the original order::

    split.state_dict().keys() == original.state_dict().keys()

(``named_parameters()`` shows the unit-local names: ``submod_1.blocks_0_attn_qkv.weight``.)
"""

from __future__ import annotations

import collections
import copy
import operator
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.fx.passes.split_module import split_module

from distopt.capture import keep_state_names
from distopt.errors import ConfigError
from distopt.passes.fsdp.partition import PLAN_META, PartitionPlan, apply_plan, unit_of

UNITS_META = "distopt_unit_modules"
"""``split.meta[UNITS_META]``: names of the unit submodules, in execution order."""


def plan_of(gm: nn.Module) -> PartitionPlan | None:
    meta = getattr(gm, "meta", None)
    plan = meta.get(PLAN_META) if isinstance(meta, dict) else None
    return plan if isinstance(plan, PartitionPlan) else None


def agree_across_ranks(gm: torch.fx.GraphModule) -> None:
    """Make every rank use rank 0's partition of ``gm`` (a collective when a group is up).

    Profiled costs differ slightly between processes, and a rank-local plan could deadlock FSDP.
    Every rank traced the same model, so node names (which the plan refers to) agree.
    """
    plan = plan_of(gm)
    if plan is None or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() == 1:
        return
    box: list[Any] = [plan if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    apply_plan(gm, box[0])


def materialize_units(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule whose children ``submod_<i>`` are the partition's units (shared parameters)."""
    if plan_of(gm) is None:
        raise ConfigError(
            f"{type(gm).__name__}: no partition to materialize (run the 'partition' pass)"
        )
    # Cut a copy: moving views across units (below) must not change the caller's graph.
    work = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), type(gm).__name__)
    assign: dict[torch.fx.Node, int] = {}
    previous = 0
    for node in work.graph.nodes:
        if node.op not in ("placeholder", "output"):
            previous = assign[node] = unit_of(node, previous)
    _views_where_used(work, assign)
    _boundaries_not_views(work, assign)
    split = split_module(work, work, lambda node: assign[node], keep_original_order=True)
    # A tied tensor (an LM head sharing the embedding's weight) has one key per module using it.
    original: dict[int, list[str]] = collections.defaultdict(list)
    for key, tensor in gm.state_dict(keep_vars=True).items():
        original[id(tensor)].append(key)
    key_map: dict[str, str] = {}
    unit_of_tensor: dict[int, str] = {}
    unit_names: list[str] = []
    for name, sub in split.named_children():
        unit_names.append(name)
        for local, tensor in sub.state_dict(keep_vars=True).items():
            keys = original.get(id(tensor))
            if keys is None:
                _make_non_persistent(sub, local)  # a traced constant, not model state
                continue
            first = unit_of_tensor.setdefault(id(tensor), name)
            if first != name:
                raise ConfigError(
                    f"parameter {keys[0]!r} is used by units {first} and {name}: a tensor must "
                    "belong to one unit"
                )
            key_map[f"{name}.{local}"] = _original_key(local, keys)
    owners: dict[str, str] = {}
    for split_key, orig_key in key_map.items():
        owners.setdefault(orig_key, split_key)
    order = list(gm.state_dict().keys())
    split.register_state_dict_post_hook(_OriginalNames(key_map, order))
    split.register_load_state_dict_pre_hook(_UnitNames(owners))
    keep_state_names(gm, split)  # state the forward never touches stays at its original path
    split.meta[PLAN_META] = plan_of(gm)
    split.meta[UNITS_META] = unit_names
    return split


_VIEW_METHODS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "transpose",
        "permute",
        "squeeze",
        "unsqueeze",
        "flatten",
        "unflatten",
        "expand",
        "expand_as",
        "narrow",
        "select",
        "split",
        "chunk",
        "unbind",
        "t",
        "movedim",
        "swapaxes",
        "diagonal",
        "as_strided",
        "detach",
    }
)
_VIEW_FUNCTIONS = frozenset(
    {
        torch.reshape,
        torch.transpose,
        torch.permute,
        torch.squeeze,
        torch.unsqueeze,
        torch.flatten,
        torch.narrow,
        torch.select,
        torch.split,
        torch.chunk,
        torch.unbind,
        torch.t,
        torch.movedim,
        torch.swapaxes,
        torch.diagonal,
        torch.as_strided,
        torch.detach,
        operator.getitem,
    }
)
_VIEW_MODULES = (nn.Flatten, nn.Unflatten)


def _is_view(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether ``node`` returns (or may return) a view of its input: known aliasing torch
    functions, tensor methods and modules."""
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op == "call_function":
        return node.target in _VIEW_FUNCTIONS
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), _VIEW_MODULES)
    return False


def _views_where_used(gm: torch.fx.GraphModule, assign: dict[torch.fx.Node, int]) -> None:
    """Compute a view in each later unit that uses it, never at the end of the unit before.

    A unit returning a view makes FSDP2 warn that an in-place op on it would skip the unit's
    pre-backward hook ("returned a view tensor ... wrong gradients"); the cut, not the model,
    put the view on a unit boundary. Views cost nothing, so each consuming unit recomputes it
    from its base (numerics unchanged); a chain of views moves whole, the base of a parameter
    stays where the parameter is.
    """
    graph = gm.graph
    position: dict[torch.fx.Node, float] = {n: float(i) for i, n in enumerate(graph.nodes)}
    for node in reversed(list(graph.nodes)):
        if node.op in ("placeholder", "output") or not _is_view(gm, node):
            continue
        if any(a.op == "get_attr" for a in node.all_input_nodes):
            continue
        home = assign[node]
        by_unit: dict[int, list[torch.fx.Node]] = {}
        for user in node.users:
            if user.op != "output" and assign[user] != home:
                by_unit.setdefault(assign[user], []).append(user)
        for unit, users in by_unit.items():
            first = min(users, key=position.__getitem__)
            with graph.inserting_before(first):
                copy_ = graph.node_copy(node)
            assign[copy_] = unit
            position[copy_] = position[first] - 0.5
            for user in users:
                user.replace_input_with(node, copy_)
        if not node.users:
            graph.erase_node(node)
            del assign[node]
    graph.lint()
    gm.recompile()


@torch.fx.wrap
def not_a_view(value: Any) -> Any:
    """``value``, copied if it is a tensor that views another (see :func:`_boundaries_not_views`)."""
    if isinstance(value, torch.Tensor) and value._is_view():
        return value.clone()
    return value


def _boundaries_not_views(gm: torch.fx.GraphModule, assign: dict[torch.fx.Node, int]) -> None:
    """Pass every value that leaves its unit through :func:`not_a_view`.

    Some ops return a view of a temporary: ``nn.Linear`` on a 3-D input is a 2-D matmul viewed
    back to 3-D. A unit ending in one makes FSDP2 warn that it "returned a view tensor"; unlike the
    graph's own views (:func:`_views_where_used`) it cannot move, as it holds parameters. Whether
    it is a view is known only when it runs, so the copy is made only then (one activation per
    boundary, and only for such units); values are unchanged.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op in ("placeholder", "output", "get_attr") or node.target is not_a_view:
            continue
        home = assign[node]
        leaving = [u for u in node.users if u.op != "output" and assign[u] != home]
        if not leaving:
            continue
        with graph.inserting_after(node):
            own = graph.call_function(not_a_view, (node,))
        assign[own] = home
        for user in leaving:
            user.replace_input_with(node, own)
    graph.lint()
    gm.recompile()


def unit_modules(split: nn.Module) -> list[nn.Module]:
    """The unit submodules of a :func:`materialize_units` result, in execution order."""
    names = getattr(split, "meta", {}).get(UNITS_META)
    if names is None:
        raise ConfigError(
            f"{type(split).__name__}: not a materialized partition (no {UNITS_META} meta)"
        )
    return [split.get_submodule(n) for n in names]


def _make_non_persistent(module: nn.Module, key: str) -> None:
    owner_path, _, attr = key.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if attr in owner._buffers:
        owner._non_persistent_buffers_set.add(attr)


def _original_key(local: str, keys: list[str]) -> str:
    """Which of a tensor's original keys a unit-local key stands for: the one it flattens
    (``layers_0_ln1.weight`` for ``layers.0.ln1.weight``), else the first."""
    flat = local.replace(".", "_")
    return next((key for key in keys if key.replace(".", "_") == flat), keys[0])


class _OriginalNames:
    """``state_dict`` post-hook: ``submod_1.blocks_0_ln1.weight`` → ``blocks.0.ln1.weight``."""

    def __init__(self, key_map: dict[str, str], order: list[str]):
        self.key_map = key_map
        self.rank = {k: i for i, k in enumerate(order)}

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        ours = [k for k in state_dict if k.startswith(prefix)]
        entries = []
        for key in ours:
            rest = key[len(prefix) :]
            entries.append((self.key_map.get(rest, rest), state_dict.pop(key)))
        entries.sort(key=lambda kv: self.rank.get(kv[0], len(self.rank)))
        for name, value in entries:
            state_dict[prefix + name] = value


class _UnitNames:
    """``load_state_dict`` pre-hook: the inverse renaming (original key → unit-local key)."""

    def __init__(self, owners: dict[str, str]):
        self.owners = owners

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        for key in [k for k in state_dict if k.startswith(prefix)]:
            local = self.owners.get(key[len(prefix) :])
            if local is not None:
                state_dict[prefix + local] = state_dict.pop(key)
