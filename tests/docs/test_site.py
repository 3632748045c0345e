"""The documentation site builds with --strict, and what it says matches the code it documents.

- every environment variable the code reads is on the configuration page, and every one on that page is read;
- every `loraplex ...` command of the getting-started page exists in the CLI with the options it is given,
  and every `make ...` target there exists;
- every `docs/<page>.md#<anchor>` a source comment cites is a page of the site with that heading.
"""

from __future__ import annotations

import html
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import click

from app.cli.main import cli
from tests.docs.conftest import DOCS_DIR, REPO_ROOT

CODE_DIRS = ("app", "engine", "loraplex_kernels")
CITING_DIRS = ("app", "engine", "loraplex_kernels", "scripts", "tests")
# A string literal that is a whole variable name: how the code reads the environment (os.environ.get("X"),
# env.get("X"), _int(env, "X"), click's envvar="X", NAME_ENV = "X").
ENV_LITERAL = re.compile(r"""["'](LORAPLEX_[A-Z0-9_]+|DATABASE_URL)["']""")
ENV_NAME = re.compile(r"\b(LORAPLEX_[A-Z0-9_]*[A-Z0-9]|DATABASE_URL)\b")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELL_LANGUAGES = {"sh", "bash", "shell", "console"}
DOC_CITATION = re.compile(r"docs/([a-z0-9-]+\.md)(?:#([a-z0-9_-]+))?")  # mkdocs keeps underscores in anchors


def env_names_read_by_code() -> set[str]:
    names = set()
    for folder in CODE_DIRS:
        for path in (REPO_ROOT / folder).rglob("*.py"):
            names.update(ENV_LITERAL.findall(path.read_text()))
    return names


def page_text(site: Path, page: str) -> str:
    """The visible text of a built page (tags dropped, entities decoded), without the site's navigation."""
    document = (site / page / "index.html").read_text()
    article = document[document.index("<article") : document.index("</article>")]
    return html.unescape(re.sub(r"<[^>]+>", " ", article))


def test_site_builds_strict(built_site: Path) -> None:
    """Broken links, missing pages and unknown anchors fail the build; every page is rendered."""
    for page in DOCS_DIR.glob("*.md"):
        rendered = built_site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert rendered.is_file(), f"docs/{page.name} was not rendered"


def test_configuration_page_lists_every_setting_the_code_reads(built_site: Path) -> None:
    in_code = env_names_read_by_code()
    on_page = set(ENV_NAME.findall(page_text(built_site, "configuration")))
    assert in_code, "no environment variable found in the code: the scan is broken"
    missing = sorted(in_code - on_page)
    assert not missing, f"read by the code but not on docs/configuration.md: {missing}"
    stale = sorted(on_page - in_code)
    assert not stale, f"on docs/configuration.md but read nowhere in {', '.join(CODE_DIRS)}: {stale}"


def test_configuration_table_comes_from_the_settings_code(built_site: Path) -> None:
    """Each field of Settings has its row, with the field's docstring: a changed docstring shows at the next build."""
    spec = importlib.util.spec_from_file_location("settings_table", DOCS_DIR / "hooks" / "settings_table.py")
    hook = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = hook  # dataclasses look their module up there
    spec.loader.exec_module(hook)
    text = "".join(page_text(built_site, "configuration").split())  # tags became spaces: compare without any
    rows = hook.setting_rows()
    assert len(rows) >= 20
    for row in rows:
        description = "".join(row.description.replace("`", "").split())
        assert description in text, f"{row.env_names}: its docstring is not shown"


def shell_commands(markdown: str) -> list[list[str]]:
    """Each command of the page's shell blocks as words: `$(...)` bodies and `&&`/`;`/`|` parts included."""
    commands = []
    for language, body in FENCE.findall(markdown):
        if language not in SHELL_LANGUAGES:
            continue
        body = body.replace("\\\n", " ")
        for line in body.splitlines():
            line = line.split(" #", 1)[0].strip()
            if not line:
                continue
            parts = [*re.findall(r"\$\(([^)]*)\)", line), re.sub(r"\$\([^)]*\)", "VALUE", line)]
            for part in parts:
                for command in re.split(r"&&|\|\||;|\|", part):
                    words = shlex.split(command, comments=False)
                    while (words and re.match(r"^[A-Z_]+=", words[0])) or words[:1] == ["export"]:
                        words = words[1:]
                    if words:
                        commands.append(words)
    return commands


def check_cli_command(words: list[str]) -> None:
    """Walk `loraplex ARGS...` down the click tree; every option given must exist on the way."""
    command: click.Command = cli
    path = ["loraplex"]
    options = {option for param in cli.params for option in param.opts} | {"--help"}
    for word in words[1:]:
        if word.startswith("-"):
            name = word.split("=", 1)[0]
            assert name in options, f"`{' '.join(words)}`: `{' '.join(path)}` has no option {name}"
            continue
        if isinstance(command, click.Group):
            assert word in command.commands, f"`{' '.join(words)}`: `{' '.join(path)}` has no command {word!r}"
            command = command.commands[word]
            path.append(word)
            options |= {option for param in command.params for option in param.opts}
    assert not isinstance(command, click.Group), f"`{' '.join(words)}` names a group, not a command"


def test_getting_started_commands_exist() -> None:
    markdown = (DOCS_DIR / "getting-started.md").read_text()
    commands = shell_commands(markdown)
    cli_commands = [words for words in commands if Path(words[0]).name == "loraplex"]
    assert len(cli_commands) >= 4, "the getting-started page should show the CLI"
    for words in cli_commands:
        check_cli_command(words)
    targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO_ROOT / "Makefile").read_text(), re.MULTILINE))
    for words in commands:
        if words[0] == "make":
            assert set(words[1:]) <= targets, f"`{' '.join(words)}`: no such target in the Makefile"


def test_cli_check_catches_a_wrong_command() -> None:
    """The walk refuses what the CLI does not have, so the test above can fail."""
    for wrong in (["loraplex", "tenant", "create", "acme"], ["loraplex", "keys", "create", "acme", "--nmae", "x"]):
        try:
            check_cli_command(wrong)
        except AssertionError:
            continue
        raise AssertionError(f"{wrong} passed the check")


def test_source_citations_point_at_pages_and_headings(built_site: Path) -> None:
    cited = 0
    for folder in CITING_DIRS:
        for path in (REPO_ROOT / folder).rglob("*.py"):
            for page, anchor in DOC_CITATION.findall(path.read_text()):
                where = path.relative_to(REPO_ROOT)
                assert (DOCS_DIR / page).is_file(), f"{where} cites docs/{page}, which does not exist"
                cited += 1
                if anchor:
                    rendered = (built_site / Path(page).stem / "index.html").read_text()
                    assert f'id="{anchor}"' in rendered, f"{where} cites docs/{page}#{anchor}: no such heading"
    assert cited > 0
