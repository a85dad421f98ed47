"""The package's import graph, folder by folder: each top-level folder (or top-level module) of the package is one
layer, a folder imports only folders below it, and the folders form no knot. Inside a folder its modules may import
each other, without a circle.

Read from the source with ``ast`` (every import, inside functions too), so an import that would close a circle
fails here before it can fail at import time in some order of first use. ``python tests/test_architecture.py --graph``
prints the folder-level graph (docs/architecture.md: Layers).
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterable, Iterator, Mapping

PACKAGE = "lightning_static_dist"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)

#: top-level folder (or module) -> its layer, 0 at the top; a folder imports only folders of a higher number. The
#: package's root (the public facade, which imports everything) is not a layer.
LAYERS: dict[str, int] = {
    # the command line (``python -m lightning_static_dist``, then lsd-train, lsd-report, lsd-consolidate)
    "__main__": 0, "cli": 1,
    # what the command line runs: the run file, the Lightning and Fabric front ends, the reports of a finished run
    "runfile": 2, "strategy": 2, "fabric": 2, "report_plot": 2, "sweep_report": 2,
    # the Trainer front end's checkpoint reading and writing
    "trainer_checkpoints": 3,
    # each feature's part of the front ends' hooks (the step participants)
    "participants": 4,
    # what the participants run in and with: the ranks' processes (launch, SIGTERM, watchdog, ending), the callbacks
    "processes": 5, "callbacks": 5,
    # the Trainer's own settings, read once for the plan
    "trainer_context": 6,
    # the strategy block, the step plan resolved from it, and the world that starts and builds them
    "plan": 7,
    # the features: compression plugs into sync
    "compression": 8,
    "sync": 9, "compile": 9, "embedding": 9, "mesh": 9,
    # what the features share: the timed trials, the checkpoint format, what the strategy offers its callbacks
    "trial": 10, "checkpoint": 10, "offer": 10,
    # the leaves: the ranks' agreement (faults, fingerprints), measurement, the simulated world
    "agreement": 11, "overlap": 11, "simulate": 11,
    "ddp_arguments": 12,
    "config": 13, "compat": 13, "wording": 13, "examples": 13,
}


def modules() -> dict[str, str]:
    """Dotted module name -> its file, for every module of the package."""
    found = {}
    for directory, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
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


def folder(module: str) -> str:
    """The top-level folder (or top-level module) that holds ``module``: its layer."""
    return module.split(".")[1]


def graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, the package's root (the public facade, which imports everything) left out."""
    known = modules()
    edges: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        if module == PACKAGE:
            continue
        edges[module] = {dep: line for dep, line in imported(module, path, known) if dep not in (PACKAGE, module)}
    return edges


def folder_graph() -> dict[str, dict[str, list[str]]]:
    """folder -> {folder it imports: the imports that make the arrow, as ``module:line -> module``}."""
    arrows: dict[str, dict[str, list[str]]] = {folder(m): {} for m in graph()}
    for module, deps in graph().items():
        for dep, line in deps.items():
            if folder(dep) != folder(module):
                arrows[folder(module)].setdefault(folder(dep), []).append(
                    f"{module.removeprefix(PACKAGE + '.')}:{line} -> {dep.removeprefix(PACKAGE + '.')}")
    return arrows


def knot(edges: Mapping[str, Iterable[str]]) -> list[str]:
    """A circle of ``edges`` (node -> the nodes it points to) as ``[a, b, ..., a]``; ``[]`` where there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in edges.get(node, ()):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state and (circle := visit(node)):
            return circle
    return []


def test_every_folder_of_the_package_has_one_layer_and_every_layer_a_folder() -> None:
    folders = {folder(m) for m in graph()}
    assert folders == set(LAYERS), (f"without a layer: {sorted(folders - set(LAYERS))};"
                                    f" a layer without a folder: {sorted(set(LAYERS) - folders)}")


def test_a_folder_imports_only_folders_below_it() -> None:
    upward = [f"{arrow} ({source}, layer {LAYERS[source]}, imports {target}, layer {LAYERS[target]})"
              for source, targets in folder_graph().items() for target, arrows in targets.items()
              if LAYERS[target] <= LAYERS[source] for arrow in arrows]
    assert not upward, "\n".join(upward)


def test_the_folders_form_no_knot() -> None:
    # implied by the layers; said on its own so that a knot is named as one, whatever the numbers say
    circle = knot(folder_graph())
    assert not circle, "a knot of folders: " + " -> ".join(circle)


def test_the_import_graph_has_no_circle() -> None:
    circle = knot(graph())
    assert not circle, "import circle: " + " -> ".join(circle)


def test_no_module_imports_the_package_root_at_import_time() -> None:
    # the root imports every folder: a folder importing it at import time is a circle through the facade. Inside a
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


def print_graph() -> None:
    """The folder-level graph, top layer first: each folder with its layer and the folders it imports."""
    arrows = folder_graph()
    for name in sorted(LAYERS, key=lambda f: (LAYERS[f], f)):
        below = sorted(arrows.get(name, {}), key=lambda f: (LAYERS.get(f, -1), f))
        print(f"{LAYERS[name]:>2} {name:<20} -> {', '.join(below) or '(nothing)'}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--graph"]:
        sys.exit("usage: python tests/test_architecture.py --graph")
    print_graph()
