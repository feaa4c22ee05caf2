"""dvc.yaml tells the truth: each stage lists exactly the src/cnnpipe modules its script imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

SRC = ROOT / "src"
PACKAGE = SRC / "cnnpipe"


def _module_file(dotted: str) -> Path | None:
    """src/ file of a `cnnpipe...` module (a package maps to its __init__.py), None outside cnnpipe."""
    if dotted != "cnnpipe" and not dotted.startswith("cnnpipe."):
        return None
    base = SRC.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    raise AssertionError(f"import of {dotted}: no such module under {SRC}")


def _dotted(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[Path]:
    """cnnpipe files `path` imports directly, anywhere in it (function-level imports too)."""
    package = _dotted(path) if path.is_relative_to(PACKAGE) else ""
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]  # `from pkg import module`
        for name in names:
            try:
                module = _module_file(name)
            except AssertionError:
                if name in names[1:]:  # `from x import function`: not a module
                    continue
                raise
            if module is not None:
                found.add(module)
    return found


def transitive_modules(script: Path) -> set[str]:
    """Every cnnpipe module the script runs, as paths relative to the project (package __init__s left
    out: they hold no code, which `test_package_inits_hold_no_code` keeps true)."""
    seen: set[Path] = set()
    todo = [script]
    while todo:
        for module in imported_modules(todo.pop()):
            if module not in seen:
                seen.add(module)
                todo.append(module)
    return {str(p.relative_to(ROOT)) for p in seen if p.name != "__init__.py"}


def stages() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def _body(stage: dict) -> dict:
    return stage.get("do", stage)


def _script(stage: dict) -> Path:
    return ROOT / next(word for word in _body(stage)["cmd"].split() if word.startswith("stages/"))


@pytest.mark.parametrize("name", sorted(stages()))
def test_stage_lists_exactly_the_modules_it_imports(name):
    body = _body(stages()[name])
    script = _script(stages()[name])
    listed = {d for d in body.get("deps", []) if isinstance(d, str) and d.startswith("src/")}
    imported = transitive_modules(script)
    missing, extra = sorted(imported - listed), sorted(listed - imported)
    assert not missing, f"dvc.yaml stage {name!r} runs {script.name}, which imports {missing}: add them to its deps"
    assert not extra, f"dvc.yaml stage {name!r} lists {extra}, which {script.name} never imports: remove them"
    assert str(script.relative_to(ROOT)) in body["deps"], f"stage {name!r} must list its own script"


def test_package_inits_hold_no_code():
    for init in PACKAGE.rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        code = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
                and not (isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant))]
        assert not code, f"{init} holds code; list it in dvc.yaml deps or move the code to a module"


def test_the_walker_follows_relative_and_function_level_imports(tmp_path):
    """The walker itself: evaluate.py reaches engine.py only through evaluation.py."""
    found = transitive_modules(ROOT / "stages" / "evaluate.py")
    assert {"src/cnnpipe/evaluate/evaluation.py", "src/cnnpipe/train/engine.py",
            "src/cnnpipe/train/distributed.py"} <= found
    assert "src/cnnpipe/train/trainer.py" not in found


ENTRY_POINTS = {PACKAGE / "predict.py", PACKAGE / "promote.py"}
"""`python -m cnnpipe.predict` and `python -m cnnpipe.promote`: root-level names for the CLIs of deploy and
release, like stage scripts (imports, hold no logic)."""


def _package(path: Path) -> str:
    """The subpackage a file belongs to (`train`, `profile`, ...), or "" for a root module."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else ""


def package_graph() -> dict[str, set[str]]:
    """Which packages each package imports ("" = the root modules), over every file under src/cnnpipe."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path in ENTRY_POINTS:
            continue
        graph.setdefault(_package(path), set()).update(_package(m) for m in imported_modules(path))
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    todo, seen = [start], set()
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_no_package_imports_one_that_depends_on_it():
    """Layers: root modules (config, params, files, hardware, models, monitor) < data < train < the
    stage packages (profile, plan, evaluate, deploy). What two packages share lives below both."""
    graph = package_graph()
    assert graph[""] <= {""}, f"root modules import packages {sorted(graph[''] - {''})}: move the code down"
    upward = [(a, b) for a, deps in graph.items() for b in deps if a != b and _reaches(graph, b, a)]
    assert not upward, f"imports that run against the layers (package pairs that import each other): {upward}"
    assert "data" not in graph or graph["data"] <= {"", "data"}
    assert graph["train"] <= {"", "data", "train"}


def test_the_layer_check_sees_an_upward_import(monkeypatch):
    """The check itself: an import from train into profile (which imports train) is a cycle it finds."""
    real = imported_modules

    def with_upward(path: Path) -> set[Path]:
        found = real(path)
        return found | {PACKAGE / "profile" / "trials.py"} if path.name == "engine.py" else found

    monkeypatch.setitem(globals(), "imported_modules", with_upward)
    graph = package_graph()
    assert "profile" in graph["train"] and _reaches(graph, "profile", "train")
