"""Each participant is typed with the part of the strategy it reads (``participants/base.py``: ``PlanView``,
``RanksView``, ``TrainingView``, ``StepView`` and their unions), not the whole ``StrategyView``: read from the
participants' own source, so that a participant reading outside its view fails here."""

from __future__ import annotations

import ast
import pathlib
from typing import Optional

import lightning_static_dist.participants as participants
from lightning_static_dist.participants import base

FOLDER = pathlib.Path(participants.__file__).parent


def _members(view: str) -> set[str]:
    """What ``base.<view>`` offers: its members and those of the views it joins."""
    protocol = getattr(base, view)
    return {name for cls in protocol.__mro__ if cls.__module__ == base.__name__
            for name in vars(cls) if not name.startswith("_")}


def _reads_view(node: ast.AST, aliases: frozenset[str] = frozenset()) -> bool:
    """Whether ``node`` is the view: a name ``view`` (or one assigned from the view), or an attribute ``_view``."""
    return (isinstance(node, ast.Name) and node.id in {"view", *aliases}) or (
        isinstance(node, ast.Attribute) and node.attr == "_view")


def _view_of(node: ast.AST) -> Optional[str]:
    """The annotation of the ``view`` argument of a function, or of a class's ``__init__``."""
    functions = [node] if isinstance(node, ast.FunctionDef) else [
        f for f in getattr(node, "body", []) if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
    for function in functions:
        for arg in function.args.args:
            if arg.arg == "view" and arg.annotation is not None:
                return ast.unparse(arg.annotation)
    return None


def _typed_parts(source: str) -> dict[str, tuple[str, set[str], set[str]]]:
    """Each top-level class or function taking a view: (its view, what it reads of it, whom it hands it to)."""
    found = {}
    for node in ast.parse(source).body:
        view = _view_of(node)
        if view is None:
            continue
        reads, hands = set(), set()
        aliases = frozenset(t.id for sub in ast.walk(node) if isinstance(sub, ast.Assign) and _reads_view(sub.value)
                            for t in sub.targets if isinstance(t, ast.Name))  # (strategy = self._view ...)
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and _reads_view(sub.value, aliases):
                reads.add(sub.attr)
            elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name):
                arguments = [*sub.args, *(k.value for k in sub.keywords)]
                if sub.func.id == "getattr" and len(sub.args) >= 2 and _reads_view(sub.args[0], aliases):
                    name = sub.args[1]  # (getattr(view, "name"): a read; a computed name is refused below)
                    reads.add(name.value if isinstance(name, ast.Constant) else "<computed>")
                elif any(_reads_view(a, aliases) for a in arguments):
                    hands.add(sub.func.id)
        found[node.name] = (view, reads, hands)
    return found


def _all_parts() -> dict[str, tuple[str, set[str], set[str]]]:
    parts: dict[str, tuple[str, set[str], set[str]]] = {}
    for path in sorted(FOLDER.glob("*.py")):
        parts.update(_typed_parts(path.read_text()))
    return parts


def _outside(parts: dict[str, tuple[str, set[str], set[str]]]) -> dict[str, list[str]]:
    """What each part reads, or needs of whom it hands its view to, beyond the view it is typed with."""
    found = {}
    for name, (view, reads, hands) in parts.items():
        offered = _members(view)
        needed = set(reads)
        for callee in hands & parts.keys():
            needed |= _members(parts[callee][0])
        if needed - offered:
            found[name] = sorted(needed - offered)
    return found


def test_each_participant_reads_only_the_view_it_is_typed_with() -> None:
    parts = _all_parts()
    assert _outside(parts) == {}
    narrow = {name: view for name, (view, _, _) in parts.items() if view != "StrategyView"}
    # most parts see less than the whole strategy: the timeouts no module, the SIGTERM agreement no plan
    assert len(narrow) >= 12 and len(_members("StrategyView")) == 17
    assert narrow["CollectiveTimeout"] == "WorldView" and "lightning_module" not in _members("WorldView")
    assert narrow["SigtermAgreement"] == "RanksView" and "plan" not in _members("RanksView")
    assert narrow["run_hazards"] == "TrainingView"


def test_a_participant_reading_outside_its_view_is_found() -> None:
    source = '''
class Timeout:
    def __init__(self, view: WorldView) -> None:
        self._view = view

    def setup(self) -> None:
        self._view.lightning_module.train()
        syncs(self._view)

def syncs(view: StepView) -> bool:
    return view.context is not None
'''
    assert _outside(_typed_parts(source)) == {"Timeout": ["context", "lightning_module", "preempted"]}
    # an alias of the view, getattr with a name, and a hand-off by keyword are reads too
    source = source.replace("self._view.lightning_module.train()", "strategy = self._view\n        strategy.model"
                            "\n        getattr(self._view, 'optimizers')").replace("syncs(self._view)", "syncs(view=self._view)")
    assert _outside(_typed_parts(source)) == {"Timeout": ["context", "model", "optimizers", "preempted"]}


def test_a_view_is_taken_under_the_name_view() -> None:
    # the check above follows the argument named view: a view taken under another name would escape it
    other = {f"{path.name}: {node.name}({arg.arg})" for path in sorted(FOLDER.glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)
             for arg in node.args.args + node.args.kwonlyargs
             if arg.annotation is not None and ast.unparse(arg.annotation).endswith("View") and arg.arg != "view"}
    assert other == set()
