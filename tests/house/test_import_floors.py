"""docs/design.md's picture of who imports whom holds for the code: its floors, listed top to
bottom, are each imported only from above (every import, including those inside functions),
every module of the library stands on one of them, and no files import each other in a loop.
A new import up a floor, or a circle, fails here rather than in a reviewer's reading."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.library_files import library_files

ROOT = Path(__file__).resolve().parents[2]


def _floors() -> list[list[str]]:
    """The picture's floors, top first: each a list of paths (a folder ends with a slash)."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("**Floors, top to bottom**", 1)[1].split("```", 2)[1]
    return [line.split() for line in block.splitlines() if line.strip()]


def _module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def _imports(path: str, modules: dict[str, str]) -> set[str]:
    """The library files ``path`` imports, wherever the import stands."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # A submodule by its own name; a name the package defines, the package.
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.append(submodule if submodule in modules else node.module)
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found.update(modules[n] for n in names if n in modules and modules[n] != path)
    return found


def _floor_of(path: str, floors: list[list[str]]) -> int | None:
    """The index of the floor whose longest matching path holds ``path``."""
    best = None
    for index, floor in enumerate(floors):
        for place in floor:
            holds = path == place or (place.endswith("/") and path.startswith(place))
            if holds and (best is None or len(place) > best[1]):
                best = (index, len(place))
    return best and best[0]


def _upward(graph: dict[str, set[str]], floors: list[list[str]]) -> list[str]:
    return [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in sorted(targets)
        if _floor_of(b, floors) < _floor_of(a, floors)
    ]


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One loop of imports, if there is any (depth-first, iterative)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    for start in graph:
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


@pytest.fixture(scope="module")
def house():
    files = library_files()
    modules = {_module_name(f): f for f in files}
    graph = {f: _imports(f, modules) for f in files}
    # A package's face that imports nothing (its docstring) stands on no floor.
    return _floors(), {f: i for f, i in graph.items() if i or not f.endswith("__init__.py")}


def test_every_module_stands_on_a_floor_of_the_picture(house):
    floors, graph = house
    homeless = [f for f in graph if _floor_of(f, floors) is None]
    assert not homeless, "docs/design.md's floors do not hold: " + ", ".join(homeless)


def test_no_import_runs_up_a_floor(house):
    floors, graph = house
    upward = _upward(graph, floors)
    assert not upward, "imports up a floor of docs/design.md's picture: " + "; ".join(upward)


def test_no_files_import_each_other_in_a_loop(house):
    _, graph = house
    circle = _circle(graph)
    assert circle is None, "an import circle: " + " -> ".join(circle)


def test_the_checks_catch_an_upward_import_and_a_circle(house):
    floors, graph = house
    below = next(f for f in graph if _floor_of(f, floors) == len(floors) - 1)
    above = next(f for f in graph if _floor_of(f, floors) == 0)
    assert _upward({below: {above}, above: set()}, floors) == [f"{below} -> {above}"]
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
