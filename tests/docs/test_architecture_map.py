"""The architecture page maps every module of `app/` and `engine/`, and names no module that does not exist.

Each folder has a table on docs/architecture.md headed ``| in `<folder>/` | ... |``, with a row per module
(or per few modules) saying what it owns; the first cell names the modules, in backticks, relative to the
folder. A module added without its row, or a row left behind by a module renamed or removed, fails here.
"""

from __future__ import annotations

import itertools
import re

from tests.docs.conftest import DOCS_DIR, REPO_ROOT

PACKAGES = ("app", "engine")
PAGE = DOCS_DIR / "architecture.md"
TABLE_HEAD = re.compile(r"^\| in `(?P<folder>[a-z0-9_]+(?:/[a-z0-9_]+)*)/` \|")
MODULE_NAME = re.compile(r"`([a-z0-9_]+\.py)`")


def modules_in_code() -> set[str]:
    """Every module of the mapped packages, ``app/openai/service.py`` style; packages' ``__init__.py`` aside."""
    return {
        path.relative_to(REPO_ROOT).as_posix()
        for package in PACKAGES
        for path in (REPO_ROOT / package).rglob("*.py")
        if path.name != "__init__.py"
    }


def modules_on_page(markdown: str) -> set[str]:
    """The modules named in the first cell of the rows of each ``| in `<folder>/` |`` table, with their folder."""
    named = set()
    lines = markdown.splitlines()
    for index, line in enumerate(lines):
        head = TABLE_HEAD.match(line)
        if head is None:
            continue
        rows = itertools.takewhile(lambda row: row.startswith("|"), lines[index + 2 :])  # past the |---| line
        for row in rows:
            first_cell = row.split("|")[1]
            named.update(f"{head['folder']}/{name}" for name in MODULE_NAME.findall(first_cell))
    return named


def test_every_module_of_app_and_engine_is_on_the_architecture_page() -> None:
    missing = sorted(modules_in_code() - modules_on_page(PAGE.read_text()))
    assert not missing, (
        f"not on docs/architecture.md: {missing}; add a row for each to its folder's table "
        "(| in `<folder>/` | ... |), saying what the module owns"
    )


def test_every_module_the_architecture_page_names_exists() -> None:
    stale = sorted(modules_on_page(PAGE.read_text()) - modules_in_code())
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}; rename or remove their rows"


def test_the_map_check_catches_a_module_left_out() -> None:
    """A row taken out of the page is missed, and a module of a folder with no table at all is too."""
    markdown = PAGE.read_text()
    on_page = modules_on_page(markdown)
    assert {"engine/drivers/step_loop.py", "app/settings.py"} <= on_page
    without_row = "\n".join(line for line in markdown.splitlines() if "`step_loop.py`" not in line)
    assert "engine/drivers/step_loop.py" not in modules_on_page(without_row)
    without_head = markdown.replace("| in `engine/drivers/` |", "| in engine's drivers |")
    assert not any(name.startswith("engine/drivers/") for name in modules_on_page(without_head))
