"""MkDocs hook: the configuration page's table of settings, generated from ``app/settings.py``.

The page holds the marker ``<!-- settings-table -->``; at build time it becomes one row per field of
``Settings``: the environment variable(s) ``Settings.from_env`` reads for it, the field's docstring, and the
default a process with none of them set gets, in the variable's unit. A setting added to the code appears on
the page at the next build, so the table cannot drift from the code.
"""

from __future__ import annotations

import ast
import itertools
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path

MARKER = "<!-- settings-table -->"
REPO_ROOT = Path(__file__).resolve().parents[2]
SETTINGS_SOURCE = REPO_ROOT / "app" / "settings.py"
ENV_NAME = re.compile(r"^(LORAPLEX_[A-Z0-9_]+|DATABASE_URL)$")
# A variable named in a unit the field does not hold: the field's value is divided by this to show the default.
UNIT_DIVISORS = {"_MB": 1024**2, "_KB": 1024}


@dataclass(frozen=True, slots=True)
class SettingRow:
    """One row of the table: the variables read, what the field means, its default as the user writes it."""

    env_names: tuple[str, ...]
    field_name: str
    description: str
    default: str


def setting_rows(source_path: Path = SETTINGS_SOURCE) -> list[SettingRow]:
    """Every field of ``Settings`` that ``from_env`` fills from the environment, in the class's order."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))  # this checkout's settings, not an installed copy's
    from app.settings import Settings

    tree = ast.parse(source_path.read_text())
    settings_class = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Settings")
    docstrings = _field_docstrings(settings_class)
    env_by_field = _env_names_by_field(settings_class)
    defaults = Settings.from_env({})
    rows = []
    for field in fields(Settings):
        env_names = env_by_field.get(field.name, ())
        if not env_names:
            continue
        value = getattr(defaults, field.name)
        rows.append(
            SettingRow(
                env_names=env_names,
                field_name=field.name,
                description=_tidy(docstrings.get(field.name, ""), env_names),
                default=_render_default(value, env_names[0]),
            )
        )
    return rows


def settings_table(source_path: Path = SETTINGS_SOURCE) -> str:
    """The Markdown table that replaces the marker."""
    lines = ["| variable | meaning | default |", "|---|---|---|"]
    for row in setting_rows(source_path):
        names = ", ".join(f"`{name}`" for name in row.env_names)
        description = row.description.replace("|", "\\|")
        lines.append(f"| {names} | {description} | {row.default} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """MkDocs calls this for every page; only a page with the marker changes."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, settings_table())


def _field_docstrings(settings_class: ast.ClassDef) -> dict[str, str]:
    """A field's docstring is the string expression right after its annotated assignment."""
    docstrings = {}
    body = settings_class.body
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docstrings[node.target.id] = " ".join(after.value.value.split())
    return docstrings


def _env_names_by_field(settings_class: ast.ClassDef) -> dict[str, tuple[str, ...]]:
    """From ``from_env``: the variables each keyword of ``cls(...)`` reads, directly or through a local name."""
    from_env = next(
        node for node in settings_class.body if isinstance(node, ast.FunctionDef) and node.name == "from_env"
    )
    local_env: dict[str, list[str]] = {}
    env_by_field: dict[str, tuple[str, ...]] = {}
    for node in ast.walk(from_env):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            local_env[node.targets[0].id] = _env_constants(node.value, {})
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "cls":
            for keyword in node.keywords:
                names = _env_constants(keyword.value, local_env)
                env_by_field[keyword.arg] = tuple(dict.fromkeys(names))
    return env_by_field


def _env_constants(expression: ast.AST, local_env: dict[str, list[str]]) -> list[str]:
    names = []
    for node in ast.walk(expression):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.match(node.value):
            names.append(node.value)
        elif isinstance(node, ast.Name) and node.id in local_env:
            names.extend(local_env[node.id])
    return names


def _tidy(docstring: str, env_names: tuple[str, ...]) -> str:
    """The docstring without a bare "(VARIABLE)" (the first column names it); Python's None is "unset" here."""
    for name in env_names:
        docstring = docstring.replace(f" ({name})", "")
    return re.sub(r"\bNone\b", "unset", docstring).replace("``", "`")


def _render_default(value: object, env_name: str) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`1`" if value else "`0`"
    if isinstance(value, Path):
        return "the user data folder (`~/.local/share/loraplex` on Linux)"
    if isinstance(value, int | float):
        divisor = next((d for suffix, d in UNIT_DIVISORS.items() if env_name.endswith(suffix)), 1)
        return f"`{value / divisor:g}`"
    return f"`{value}`"
