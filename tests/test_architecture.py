"""The house rules of finetune/ (docs/architecture.md), checked on the source: which folder may import which, no
import circle, and rooms small enough to read (modules, functions). That nothing imports the CLI is
tests/cli/test_library.py::test_no_stage_imports_the_cli."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "finetune"
# Leaves: anything may import them; they import only each other.
LEAVES = ("recipe", "errors", "distributed", "devices", "files", "hub", "quiet", "host_memory", "precision", "rewards", "chat_templates",
          "rank_errors", "held_signals", "rendezvous", "recipe_library")
# The stages in import order: a stage imports leaves and the stages before it, never one after it.
# run.py (the spine) wires the stages; the CLI sits on top of everything.
ORDER = ("model", "planner", "parallel", "data", "tracking", "outputs", "training", "run", "cli")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
WHOLE = "Kept whole:"  # a longer function says in its docstring why it must stay in one piece


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """Every finetune module `path` imports, at module level or inside a function, with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                     for alias in node.names]
        else:
            continue
        found += [(name, node.lineno) for name in names if name.split(".")[0] == "finetune"]
    return found


def room(module: str) -> str:
    """The stage folder or leaf a module belongs to (`finetune.model.base` -> model, `finetune.errors` -> errors)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__",):
        return "cli"  # `python -m finetune` is the command
    return parts[1]


def edges() -> list[tuple[str, str, str]]:
    known = modules()
    return [(source, target, f"{path.relative_to(REPO)}:{line}")
            for source, path in known.items() for target, line in imports(path, known) if target in known]


def test_every_room_is_a_known_stage_or_leaf():
    rooms = {room(module) for module in modules()}
    assert rooms <= set(LEAVES) | set(ORDER), f"add {sorted(rooms - set(LEAVES) - set(ORDER))} to docs/architecture.md and here"


def test_stages_import_only_leaves_and_earlier_stages():
    wrong = []
    for source, target, where in edges():
        a, b = room(source), room(target)
        if a == b or b in LEAVES:
            continue
        if a in LEAVES:
            wrong.append(f"{where}: leaf {a} imports stage {b}")
        elif ORDER.index(b) > ORDER.index(a):
            wrong.append(f"{where}: {a} imports {b}, a later stage")
    assert wrong == [], "\n".join(wrong)


def test_no_import_circle_between_modules():
    """Every import counts, at module level or inside a function (a function-level import only hides a circle from
    Python's import order, not from the design); `if TYPE_CHECKING:` blocks too. Package parents are excluded: a
    module importing its own package's `__init__` is how a package is built, not a circle. Importing a module imports the
faces (`__init__`) of the packages above it first, so those count as imported too."""
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for target, _ in imports(path, known):
            # Importing a.b.c runs a/__init__ and a/b/__init__ first: a package's face is imported with its module.
            parts = target.split(".")
            graph[name] |= {t for t in (".".join(parts[:n]) for n in range(2, len(parts) + 1))
                            if t in known and not name.startswith(t + ".") and t != name}
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt]) if nxt in stack else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert circles == [], "\n".join(circles)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_rooms_are_small_enough_to_read(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(REPO)} has {lines} lines (at most {MAX_MODULE_LINES}): split it"
    long = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            size = node.end_lineno - node.lineno + 1
            if size > MAX_FUNCTION_LINES and WHOLE not in (ast.get_docstring(node) or ""):
                long.append(f"{node.name} ({size} lines, line {node.lineno})")
    assert long == [], f"{path.relative_to(REPO)}: functions over {MAX_FUNCTION_LINES} lines without `{WHOLE}`: {long}"


OBJECTIVE_CLASSES = {"Objective", "Supervised", "Preference", "KTO", "GRPO"}


def test_no_code_outside_an_objective_asks_which_objective_it_has():
    """The loop and its helpers use the Objective contract (training/objectives/base.py): no `isinstance` of an objective
    class outside training/objectives/, and no branch on train.objective's value in the loop (docs/architecture.md:
    how to add an objective)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "objectives" in path.relative_to(PACKAGE).parts[:2]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                names = {getattr(kind, "attr", getattr(kind, "id", None)) for kind in kinds}
                if names & OBJECTIVE_CLASSES:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: isinstance(..., {sorted(names)})")
    loop = PACKAGE / "training" / "loop.py"
    for node in ast.walk(ast.parse(loop.read_text())):
        if isinstance(node, ast.Compare) and "objective" in ast.unparse(node.left):
            found.append(f"{loop.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert found == [], "\n".join(found)


WRAPPER_CLASSES = {"FSDP", "FSDPModule", "FullyShardedDataParallel", "DistributedDataParallel", "DeepSpeedEngine"}


def test_no_code_outside_the_engines_asks_which_wrapper_a_model_has():
    """What differs per strategy at run time lives in finetune/parallel/engines/ (`engine_of(model)`): no `isinstance`
    of a wrapper class and no `zero.is_engine` call anywhere else in finetune/ (docs/architecture.md: how to add an
    engine)."""
    engines = PACKAGE / "parallel" / "engines"
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(engines):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            if getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                names = {getattr(kind, "attr", getattr(kind, "id", None)) for kind in kinds}
                if names & WRAPPER_CLASSES:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: isinstance(..., {sorted(names)})")
            if getattr(node.func, "attr", getattr(node.func, "id", None)) == "is_engine":
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert found == [], "\n".join(found)


def test_every_package_is_in_the_wheel():
    """Every folder of finetune/ with an __init__.py is listed in pyproject.toml's packages (the wheel check, which
    builds and installs the wheel, found parallel/engines missing only after the whole suite had run)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(REPO).parts) for init in PACKAGE.rglob("__init__.py")}
    assert found - listed == set(), f"add {sorted(found - listed)} to pyproject.toml's [tool.setuptools] packages"
