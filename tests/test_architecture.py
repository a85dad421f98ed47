"""The package's import graph: no circles, and imports flow one way, from the front ends down to the leaves.

Read from the source with ``ast`` (every import, inside functions too), so an import that would close a circle
fails here before it can fail at import time in some order of first use.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

PACKAGE = "lightning_static_dist"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)

#: top-level room -> its layer; a module may import its own layer's rooms (acyclically) and the layers below it
LAYERS: dict[str, int] = {
    # the command line and its run file
    "__main__": 0, "cli": 0, "runfile": 0,
    # the Lightning and Fabric front ends
    "strategy": 1, "fabric": 1,
    # what a front end runs a step with (the strategy's processes and groups, Lightning's loop patch, the watchdog,
    # launchers, callbacks, reports)
    "processes.data_parallel": 2, "processes.launcher": 2, "processes.sigterm": 2, "processes.watchdog": 2,
    "processes.ending": 2, "plan": 2,
    # the strategy block: every feature's section (each defined beside its feature), checked together
    "trainer_context": 2, "trainer_checkpoints": 2, "callbacks": 2,
    "report_plot": 2, "sweep_report": 2,
    # each feature's part of the strategy's hooks (the step participants)
    "participants": 2,
    # the features
    "sync": 3, "compile": 3, "compression": 3, "embedding": 3, "mesh": 3,
    # the leaves
    "overlap": 4, "offer": 4, "checkpoint": 4, "config": 4, "ddp_arguments": 4, "compat": 4,
    # (the process package's own __init__ imports nothing; its two leaves serve the features below the strategy)
    "processes": 4, "agreement": 4,
    "simulate": 4, "trial": 4,
    "examples": 4, "wording": 4,
}


def modules() -> dict[str, str]:
    """Dotted module name -> its file, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = PACKAGE + "." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """``node``'s module as a dotted name (a relative import resolved against ``module``)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imported(module: str, path: str, known: dict[str, str]) -> Iterator[tuple[str, int]]:
    """The package's modules that ``module`` (its file at ``path``) imports, with the line of each import. Importing
    ``a.b.c`` runs ``a.b``'s ``__init__`` first: each package on the way counts as imported too."""
    def owner(name: str) -> str:
        while name not in known and "." in name:
            name = name.rpartition(".")[0]
        return name

    def with_parents(name: str) -> list[str]:
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(2, len(parts) + 1)]  # the root itself left out

    is_package = path.endswith("__init__.py")
    for node in ast.walk(ast.parse(open(path).read())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, is_package)
            if not source.startswith(PACKAGE):
                continue
            submodules = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in known]
            targets = submodules + ([owner(source)] if len(submodules) < len(node.names) else [])
        elif isinstance(node, ast.Import):
            targets = [owner(a.name) for a in node.names if a.name.startswith(PACKAGE)]
        for target in targets:
            # the packages on the way, except this module's own (Python initialises them before this module runs)
            parents = [m for m in with_parents(target)[:-1] if not module.startswith(m + ".")]
            yield from ((m, node.lineno) for m in parents + [target] if m in known)


def import_time_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    """Every statement that runs when the module is imported: the module's body, into ``if``/``try``/``with``
    blocks, not into function or class bodies' functions."""
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))


def room(module: str) -> str:
    """The top-level room of ``module``; in a package whose modules sit in different layers (``processes``), the
    module's own name within it (``processes.world``)."""
    parts = module.split(".")
    if len(parts) > 2 and ".".join(parts[1:3]) in LAYERS:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else "<root>"


def graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, the package's root (the public facade, which imports everything) left out."""
    known = modules()
    edges: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        if module == PACKAGE:
            continue
        edges[module] = {dep: line for dep, line in imported(module, path, known) if dep not in (PACKAGE, module)}
    return edges


def test_every_room_of_the_package_has_a_layer() -> None:
    assert {room(m) for m in graph()} <= set(LAYERS), sorted({room(m) for m in graph()} - set(LAYERS))


def test_imports_never_go_up_a_layer() -> None:
    upward = [f"{m} (layer {LAYERS[room(m)]}) imports {dep} (layer {LAYERS[room(dep)]}) at line {line}"
              for m, deps in graph().items() for dep, line in deps.items() if LAYERS[room(dep)] < LAYERS[room(m)]]
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_circle() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = 1
        path.append(module)
        for dep in edges.get(module, {}):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        path.pop()
        state[module] = 2
        return []

    for module in sorted(edges):
        if module not in state and (circle := visit(module)):
            raise AssertionError("import circle: " + " -> ".join(circle))


def test_no_module_imports_the_package_root_at_import_time() -> None:
    # the root imports every room: a room importing it at import time is a circle through the facade. Inside a
    # function it is how a spawned rank registers the strategy names, and allowed.
    known = modules()
    offenders = []
    for module, path in known.items():
        if module == PACKAGE:
            continue
        for node in import_time_nodes(ast.parse(open(path).read())):
            if isinstance(node, ast.Import) and any(a.name == PACKAGE for a in node.names):
                offenders.append(f"{module} line {node.lineno}")
            elif isinstance(node, ast.ImportFrom) and _absolute(node, module, path.endswith("__init__.py")) == PACKAGE:
                if not all(f"{PACKAGE}.{a.name}" in known for a in node.names):  # a name from the root's own code
                    offenders.append(f"{module} line {node.lineno}")
    assert not offenders, offenders


def test_every_layer_names_a_room_that_exists() -> None:
    assert set(LAYERS) <= {room(m) for m in modules()}, sorted(set(LAYERS) - {room(m) for m in modules()})


def test_no_step_participant_reads_lightnings_trainer() -> None:
    # the participants serve both front ends (issue 29): they get a StepContext, never a Trainer, its state enum or
    # its modules; only strategy.py adapts a Trainer to the context
    folder = os.path.join(ROOT, "participants")
    found = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(open(os.path.join(folder, name)).read())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning.pytorch.trainer"):
                found.append(f"{name}:{node.lineno} imports {node.module}")
            elif isinstance(node, (ast.Name, ast.Attribute)) and getattr(node, "id", getattr(node, "attr", "")) in (
                    "Trainer", "TrainerFn"):
                found.append(f"{name}:{node.lineno} names {getattr(node, 'id', getattr(node, 'attr', ''))}")
            elif isinstance(node, ast.Attribute) and node.attr == "trainer":
                found.append(f"{name}:{node.lineno} reads .trainer")
            elif (isinstance(node, ast.Attribute) and node.attr == "trainer_loop"
                  and name not in ("runtime.py", "resume.py")):  # the two bound to Lightning's own loop
                found.append(f"{name}:{node.lineno} reads the context's trainer_loop")
    assert not found, found


def test_no_module_is_longer_than_one_sitting() -> None:
    # issue 36: one concept per module, each short enough to read at once (STYLE.md); split along a seam, not a line
    long = {m: n for m, path in modules().items() if (n := sum(1 for _ in open(path))) > 400}
    assert not long, long
