"""The import graph of ``app/``, read from the source with ``ast``: the composition root stays at the top.

Every import counts, also one inside a function or under ``TYPE_CHECKING``: each is a dependency a reader
has to follow, and a circle closed under ``TYPE_CHECKING`` is still a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"
COMPOSITION_ROOT = "app.gateway"
ROOT_IMPORTERS = {"app.factory"}  # create_app() runs the gateway in the app's lifespan
PLUMBING = "app.web"  # the HTTP helpers every package may use, so they use no other package
SETTINGS = "app.settings"  # the environment's edge: the modules it configures depend on it, not it on them
BELOW_SETTINGS = ("app.openai", "app.tool_calls")  # what the settings must not import


def module_name(path: Path) -> str:
    parts = path.relative_to(APP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The modules of ``app/`` that the file at ``path`` imports anywhere in its body."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # from app import gateway
    return found & known


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in APP.rglob("*.py")}
    known = set(paths)
    return {name: imported_modules(path, known) - {name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports as the modules along it (the first repeated at the end), or None."""
    finished: set[str] = set()
    for start in sorted(graph):
        if start in finished:
            continue
        path = [start]  # the modules from ``start`` to the one whose imports are being followed
        pending = [iter(sorted(graph[start]))]  # for each module on the path, the imports not followed yet
        while path:
            successor = next(pending[-1], None)
            if successor is None:
                finished.add(path.pop())
                pending.pop()
            elif successor in path:
                return [*path[path.index(successor) :], successor]
            elif successor not in finished:
                path.append(successor)
                pending.append(iter(sorted(graph[successor])))
    return None


def test_the_graph_is_read_from_the_sources() -> None:
    graph = import_graph()
    assert COMPOSITION_ROOT in graph and len(graph) > 50
    assert graph["app.factory"] >= {COMPOSITION_ROOT, "app.settings"}


def test_only_the_composition_root_imports_the_gateway() -> None:
    importers = {name for name, imported in import_graph().items() if COMPOSITION_ROOT in imported}
    assert importers == ROOT_IMPORTERS, (
        f"{sorted(importers - ROOT_IMPORTERS)} import {COMPOSITION_ROOT}: take the services you need as arguments, "
        "or read the Gateway record (app/services.py) in a handler"
    )


def test_the_http_plumbing_imports_nothing_else_of_the_app() -> None:
    outside = {
        f"{name} -> {imported}"
        for name, imports in import_graph().items()
        if name.startswith(f"{PLUMBING}.")
        for imported in imports
        if imported != PLUMBING and not imported.startswith(f"{PLUMBING}.")
    }
    assert not outside, f"{PLUMBING} is below every other package: {sorted(outside)}"


def test_the_settings_import_no_http_module() -> None:
    imported = import_graph()[SETTINGS]
    wrong = sorted(name for name in imported for below in BELOW_SETTINGS if f"{name}.".startswith(f"{below}."))
    assert not wrong, (
        f"{SETTINGS} imports {wrong}: put the defaults and choices it shares with them in app/settings_defaults.py"
    )


def test_no_module_of_the_app_imports_itself_back() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_find_cycle_finds_a_circle_closed_far_from_its_start() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": {"b"}, "e": set()}
    assert find_cycle(graph) == ["b", "c", "d", "b"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
