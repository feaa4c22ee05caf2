"""No circle of files in src/cnnpipe: every module imports only modules that do not import it back,
directly or through others. Every import counts, `if TYPE_CHECKING:` and function-level ones too: a
circle hidden behind them is still a circle a reader has to untangle (the layers between packages:
tests/test_dvc_deps.py). Inside src/cnnpipe/data, the rooms import one way only (`ROOMS`)."""

from __future__ import annotations

from pathlib import Path

from test_dvc_deps import PACKAGE, imported_modules

Graph = dict[Path, set[Path]]


def file_graph() -> Graph:
    """Which cnnpipe files each file under src/cnnpipe imports."""
    return {path: imported_modules(path) for path in sorted(PACKAGE.rglob("*.py"))}


def circles(graph: Graph) -> list[list[Path]]:
    """Every group of files that reach each other through imports (Tarjan's strongly connected
    components of two or more files, or one that imports itself), each as one circle through them."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    found: list[list[Path]] = []

    def visit(node: Path) -> None:  # recursion depth is bounded by the import depth (a dozen)
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(group) > 1 or node in graph.get(node, ()):
                found.append(_circle_through(graph, set(group)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _circle_through(graph: Graph, group: set[Path]) -> list[Path]:
    """One import path that starts and ends at the same file of `group` (for the error message)."""
    start = min(group)
    path, seen = [start], {start}
    while True:
        nxt = min(n for n in graph[path[-1]] if n in group)
        if nxt in seen:
            return path[path.index(nxt):] + [nxt]
        path.append(nxt)
        seen.add(nxt)


def _names(circle: list[Path]) -> str:
    return " -> ".join(str(p.relative_to(PACKAGE)) for p in circle)


def test_no_file_in_src_imports_one_that_imports_it_back():
    found = circles(file_graph())
    assert not found, ("circles of imports (move what both sides use into a module below them): "
                       + "; ".join(_names(c) for c in found))


def test_the_check_finds_a_circle_made_of_type_checking_imports(tmp_path):
    """The check itself: the circle train/ once had, pacing importing trainer's TrainingParts under
    `if TYPE_CHECKING:` while trainer imports pacing, is found and named."""
    module = tmp_path / "pacing.py"
    module.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                      "    from cnnpipe.train.trainer import fit\n")
    trainer, pacing = PACKAGE / "train" / "trainer.py", PACKAGE / "train" / "pacing.py"
    assert imported_modules(module) == {trainer}  # the walker sees the TYPE_CHECKING import
    graph = file_graph()
    assert pacing in graph[trainer]
    graph[pacing] = graph[pacing] | imported_modules(module)
    found = circles(graph)
    assert len(found) == 1 and set(found[0]) == {trainer, pacing}
    assert _names(found[0]) in ("train/pacing.py -> train/trainer.py -> train/pacing.py",
                                "train/trainer.py -> train/pacing.py -> train/trainer.py")


def test_the_check_finds_a_longer_circle_and_a_file_importing_itself():
    a, b, c, d = (Path(f"/x/{n}.py") for n in "abcd")
    graph = {a: {b}, b: {c}, c: {a, d}, d: {d}}
    found = sorted(circles(graph), key=len)
    assert found == [[d, d], [a, b, c, a]]
    assert circles({a: {b}, b: {c}, c: set()}) == []


MAX_LINES = 400
"""Small, readable modules: DEVELOPERS.md's bar for every file under src/cnnpipe."""
SPLIT_PENDING: set[str] = set()
"""Over the bar while their split is under way elsewhere; an entry that is back under it fails the test
below, so this set empties as the splits land."""


def test_every_module_is_under_400_lines():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {name: n for name, n in sizes.items() if n >= MAX_LINES}
    assert set(over) <= SPLIT_PENDING, f"modules of {MAX_LINES} lines or more (split them): {over}"
    back = SPLIT_PENDING - set(over)
    assert not back, f"back under {MAX_LINES} lines: remove {back} from SPLIT_PENDING"


DATA = PACKAGE / "data"
ROOMS = ("sources", "store", "ingest", "splits", "loaders")
"""The data package's rooms, each importing only the ones before it (src/cnnpipe/data/__init__.py says
why the store sits under ingest and splits). prepare.py and report.py, beside them, walk the stage."""
STAGE = {DATA / "__init__.py", DATA / "prepare.py", DATA / "report.py"}


def _room(path: Path) -> str | None:
    """The data room a file lives in, None outside src/cnnpipe/data/'s rooms."""
    parts = path.relative_to(PACKAGE).parts
    return parts[1] if len(parts) > 2 and parts[0] == "data" else None


def upward_imports(graph: Graph) -> list[str]:
    """Imports against the rooms' order: a room importing a later room, or prepare or report."""
    found = []
    for path, deps in sorted(graph.items()):
        room = _room(path)
        if room is None:
            continue
        for dep in sorted(deps):
            dep_room = _room(dep)
            if dep_room is not None:
                up = ROOMS.index(dep_room) > ROOMS.index(room)
            else:
                up = dep in (DATA / "prepare.py", DATA / "report.py")
            if up:
                found.append(f"{path.relative_to(PACKAGE)} imports {dep.relative_to(PACKAGE)}")
    return found


def test_every_data_module_lives_in_a_room():
    """A module left beside prepare.py would escape the order check below."""
    loose = {p for p in DATA.rglob("*.py") if p not in STAGE and _room(p) not in ROOMS}
    assert not loose, (f"modules outside the data rooms {ROOMS} (move each into the room of the data's life it "
                       f"serves): {sorted(str(p.relative_to(PACKAGE)) for p in loose)}")


def test_the_data_rooms_import_only_the_rooms_before_them():
    found = upward_imports(file_graph())
    assert not found, ("imports up the data rooms' order " + " < ".join(ROOMS)
                       + " (move what both use into the earlier room): " + "; ".join(found))


def test_the_order_check_finds_an_import_up_the_rooms():
    """The check itself: the store importing the split ledger, or a loader importing prepare, is named."""
    graph = file_graph()
    shards, ledger = DATA / "store" / "shards.py", DATA / "splits" / "ledger.py"
    host, prepare = DATA / "loaders" / "host.py", DATA / "prepare.py"
    assert ledger in graph and not upward_imports(graph)
    graph[shards] = graph[shards] | {ledger}
    graph[host] = graph[host] | {prepare}
    assert upward_imports(graph) == ["data/loaders/host.py imports data/prepare.py",
                                     "data/store/shards.py imports data/splits/ledger.py"]
