"""Count what issue 23's acceptance is about, read from distopt's source (nothing is imported).

    python tools/structure_counts.py            # the counts, one per line
    python tools/structure_counts.py --list     # and every place behind each count
    python tools/structure_counts.py --json     # the counts as JSON (for a test or a diff)

What is counted, over every ``.py`` file under ``distopt/``:

- ``import_cycles``: strongly connected components of the graph "file A imports file B" with more
  than one file (or a file importing itself), counting *every* import statement: at module level,
  inside functions and under ``if TYPE_CHECKING``. ``from pkg import name`` is an edge to
  ``pkg/name.py`` when that module exists, else to ``pkg/__init__.py``; ``import a.b`` an edge to
  ``a/b.py`` (the parent packages' ``__init__`` files it also runs are not edges: no file names
  them). ``files_in_cycles`` is how many files those components hold.
- ``imports_in_functions``: distopt modules (or names of one) imported inside a function body,
  one per imported name: ``from distopt.x import a, b`` in a function counts 2, as issue 23 does;
  apart from the loads of an optional dependency (next item).
- ``deferred_imports``: other modules (third-party, torch, the standard library) imported inside
  a function body, counted the same way; ``modules_deferring_imports`` is how many distopt
  modules hold one. Issue 23 keeps these for optional or slow-to-import dependencies only.
  A distopt module that imports an optional dependency at its top (one that ``pyproject.toml``'s
  extras declare, ``dev`` apart), imported inside a function, is a deferred import of that
  dependency and is counted here, listed as ``ray via distopt.ps.cluster.ray_backend``: such a
  module is loaded when a job asks for it (the Ray backend of a ``ps.backend: ray`` job), as
  TorchX loads a scheduler's module by name.
- ``private_reads``: one module using another distopt module's ``_private`` name:
  ``from distopt.x import _name`` or ``alias._name`` where ``alias`` is an imported distopt
  module (dotted chains such as ``ps.client._CLIENT`` resolved).
- ``fmt_skip``: lines holding ``# fmt: skip``.
- ``shared_names``: file names that more than one module under ``distopt/`` has (one module per
  name, so that a name means one thing), apart from :data:`SHARED_BY_CONVENTION`.
- ``mutable_singletons``: module-level names holding process-wide mutable state: rebound with
  ``global`` in a function, or a container (``{}``, ``[]``, ``dict()``, ``Counter()``, ...) that the
  module mutates (item assignment, ``.append``/``.pop``/``.update``/...). ``threading.local()``
  holders are listed apart (``thread_locals``): per-thread, not shared across the process.
  ``mutable_singletons_ps`` is the part under ``distopt/ps/``.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # distopt[dev] brings tomli on Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "distopt"

_CONTAINER_CALLS = {
    "dict",
    "list",
    "set",
    "deque",
    "defaultdict",
    "Counter",
    "OrderedDict",
    "WeakValueDictionary",
    "WeakKeyDictionary",
    "WeakSet",
}
_MUTATORS = {
    "append",
    "extend",
    "insert",
    "pop",
    "popitem",
    "remove",
    "clear",
    "update",
    "setdefault",
    "add",
    "discard",
    "appendleft",
    "popleft",
}


SHARED_BY_CONVENTION = {"__init__", "__main__", "config"}
"""File names every package may have: Python's own, and ``config.py``, a package's section of the
job config (``data:``, ``pipeline:``, ...), which is one kind of thing wherever it is."""


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    imports: list[tuple[str, int, bool]] = field(default_factory=list)
    """(imported distopt module, line, inside a function)."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def load(root: Path = ROOT) -> dict[str, Module]:
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        name = _module_name(path, root)
        modules[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    return modules


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return True
    return False


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    if module.path.name != "__init__.py":
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _deepest(name: str, modules: dict[str, Module]) -> str | None:
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _targets(
    module: Module, node: ast.Import | ast.ImportFrom, modules: dict[str, Module]
) -> list[str]:
    """The distopt modules an import statement names (edges of the import graph)."""
    out: list[str] = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == PACKAGE:
                found = _deepest(alias.name, modules)
                if found:
                    out.append(found)
        return out
    base = _absolute(module, node)
    if base.split(".")[0] != PACKAGE:
        return out
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        found = sub if sub in modules else _deepest(base, modules)
        if found:
            out.append(found)
    return out


def _external(module: Module, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules outside distopt an import statement names, one per imported name."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] != PACKAGE]
    base = _absolute(module, node)
    return [] if base.split(".")[0] == PACKAGE else [base] * len(node.names)


def optional_dependencies(root: Path = ROOT) -> set[str]:
    """The import names of the optional dependencies ``pyproject.toml``'s extras declare, ``dev``
    (the tools that develop distopt) apart: ``ray[default]>=2.9`` is ``ray``."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    found = set()
    for extra, requirements in extras.items():
        if extra == "dev":
            continue
        for requirement in requirements:
            name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
            if name:
                found.add(name.group(0).lower().replace("-", "_").replace(".", "_"))
    return found


def loads_optional(module: Module, optional: set[str]) -> list[str]:
    """The optional dependencies ``module`` imports at its top (outside functions)."""
    parents = _parents(module.tree)
    return sorted(
        {
            name.split(".")[0]
            for node in ast.walk(module.tree)
            if isinstance(node, ast.Import | ast.ImportFrom) and not _in_function(node, parents)
            for name in _external(module, node)
        }
        & optional
    )


def deferred_imports(
    modules: dict[str, Module], optional: set[str] | None = None
) -> list[tuple[str, int, str]]:
    """``(module, line, imported module)`` of every name from outside distopt imported inside a
    function, and (``"ray via distopt.x"``) of every distopt module imported inside a function
    that imports an ``optional`` dependency at its top (:func:`optional_dependencies` by default)."""
    optional = optional_dependencies() if optional is None else optional
    loads = {name: loads_optional(m, optional) for name, m in modules.items()}
    out = []
    for module in modules.values():
        parents = _parents(module.tree)
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and _in_function(node, parents):
                out.extend((module.name, node.lineno, name) for name in _external(module, node))
                out.extend(
                    (module.name, node.lineno, f"{', '.join(loads[target])} via {target}")
                    for target in _targets(module, node, modules)
                    if loads[target]
                )
    return sorted(out)


def analyse_imports(
    modules: dict[str, Module], optional: set[str] | None = None
) -> list[tuple[str, int]]:
    """Fill each module's imports; (module, line) of every distopt name imported inside a
    function, but those that load an ``optional`` dependency (see :func:`deferred_imports`)."""
    optional = optional_dependencies() if optional is None else optional
    in_functions = []
    for module in modules.values():
        parents = _parents(module.tree)
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            inside = _in_function(node, parents)
            targets = _targets(module, node, modules)
            for target in targets:
                module.imports.append((target, node.lineno, inside))
                if inside and not loads_optional(modules[target], optional):
                    in_functions.append((module.name, node.lineno))
    return in_functions


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself."""
    graph = {name: sorted({t for t, _, _ in m.imports}) for name, m in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    return sorted(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reads(modules: dict[str, Module]) -> list[tuple[str, int, str]]:
    """``(module, line, what)`` for each use of another distopt module's private name."""
    out = []
    for module in modules.values():
        aliases: dict[str, str] = {}  # local name -> distopt module it is bound to
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != PACKAGE:
                        continue
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        aliases[alias.name.split(".")[0]] = PACKAGE
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, node)
                if base.split(".")[0] != PACKAGE:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in modules:
                        aliases[alias.asname or alias.name] = sub
                    elif _private(alias.name) and base != module.name:
                        out.append((module.name, node.lineno, f"from {base} import {alias.name}"))
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            chain = []
            value: ast.AST = node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if not isinstance(value, ast.Name) or value.id not in aliases:
                continue
            owner = ".".join([aliases[value.id], *reversed(chain)])
            if owner in modules and owner != module.name:
                out.append((module.name, node.lineno, f"{owner}.{node.attr}"))
    return sorted(out)


def fmt_skips(modules: dict[str, Module]) -> list[tuple[str, int]]:
    return [
        (m.name, i)
        for m in modules.values()
        for i, line in enumerate(m.path.read_text().splitlines(), 1)
        if "# fmt: skip" in line
    ]


def shared_names(modules: dict[str, Module]) -> dict[str, list[str]]:
    """Each file name (without ``.py``) more than one module has, with those modules."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for module in modules.values():
        by_name[module.path.stem].append(module.name)
    return {
        name: sorted(found)
        for name, found in sorted(by_name.items())
        if len(found) > 1 and name not in SHARED_BY_CONVENTION
    }


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name):
            return func.id
        if isinstance(func, ast.Attribute):
            return func.attr
    return None


def singletons(modules: dict[str, Module]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(mutable singletons, thread-local holders)``, each ``(module, name)``."""
    shared, per_thread = [], []
    for module in modules.values():
        top: dict[str, ast.AST] = {}
        for stmt in module.tree.body:
            targets: list[ast.AST] = []
            value = None
            if isinstance(stmt, ast.Assign):
                targets, value = stmt.targets, stmt.value
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                targets, value = [stmt.target], stmt.value
            for target in targets:
                if isinstance(target, ast.Name) and not target.id.startswith("__"):
                    top[target.id] = value  # type: ignore[assignment]
        rebound: set[str] = set()
        mutated: set[str] = set()
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Global):
                rebound.update(node.names)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Name):
                    mutated.add(node.func.value.id)
            elif isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
                for target in (
                    node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
                ):
                    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                        mutated.add(target.value.id)
        for name, value in top.items():
            if _call_name(value) == "local":
                per_thread.append((module.name, name))
                continue
            container = isinstance(
                value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp
            )
            container = container or _call_name(value) in _CONTAINER_CALLS
            if name in rebound or (container and name in mutated):
                shared.append((module.name, name))
    return sorted(shared), sorted(per_thread)


def counts(root: Path = ROOT) -> tuple[dict[str, int], dict[str, list[str]]]:
    modules = load(root)
    optional = optional_dependencies(root)
    in_functions = analyse_imports(modules, optional)
    deferred = deferred_imports(modules, optional)
    found = cycles(modules)
    reads = private_reads(modules)
    skips = fmt_skips(modules)
    same_name = shared_names(modules)
    shared, per_thread = singletons(modules)
    numbers = {
        "modules": len(modules),
        "import_cycles": len(found),
        "files_in_cycles": sum(len(c) for c in found),
        "imports_in_functions": len(in_functions),
        "deferred_imports": len(deferred),
        "modules_deferring_imports": len({m for m, _, _ in deferred}),
        "private_reads": len(reads),
        "fmt_skip": len(skips),
        "shared_names": len(same_name),
        "mutable_singletons": len(shared),
        "mutable_singletons_ps": sum(1 for m, _ in shared if m.startswith("distopt.ps")),
        "thread_locals": len(per_thread),
    }
    by_module: dict[str, int] = defaultdict(int)
    for name, _ in in_functions:
        by_module[name] += 1
    details = {
        "import_cycles": [" <-> ".join(c) for c in found],
        "imports_in_functions": [
            f"{m}: {n}" for m, n in sorted(by_module.items(), key=lambda x: (-x[1], x[0]))
        ],
        "deferred_imports": [f"{m}:{line}: {what}" for m, line, what in deferred],
        "private_reads": [f"{m}:{line}: {what}" for m, line, what in reads],
        "fmt_skip": [f"{m}:{line}" for m, line in skips],
        "shared_names": [f"{name}: {', '.join(found)}" for name, found in same_name.items()],
        "mutable_singletons": [f"{m}.{n}" for m, n in shared],
        "thread_locals": [f"{m}.{n}" for m, n in per_thread],
    }
    return numbers, details


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every place behind each count")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="repository root (default: this one)"
    )
    args = parser.parse_args(argv)
    numbers, details = counts(args.root)
    if args.json:
        print(json.dumps(numbers, indent=2))
        return 0
    for key, value in numbers.items():
        print(f"{key}: {value}")
        if args.list:
            for line in details.get(key, []):
                print(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
