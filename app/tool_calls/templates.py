"""Chat templates that render tools and calls: the shipped one, and tenants' own, rendered in a sandbox.

A template is Jinja, as Hugging Face tokenizers carry it (``messages``, ``tools``,
``add_generation_prompt``, the ``tojson`` filter, ``raise_exception``). A tenant's template is untrusted
text that becomes code: it runs in Jinja's immutable sandbox (no attribute of Python internals, no
mutation of what it is given) offered only the globals, filters and tests chat templates use, its source
is bounded to ``MAX_TEMPLATE_CHARS``, its output to ``MAX_RENDERED_CHARS``, each value it builds to the
same size (app/tool_calls/template_sandbox.py), and each render to ``MAX_RENDER_SECONDS`` and to what it may
build in all (app/tool_calls/render_deadline.py). A template that names a filter, a test or a function it
is not offered is refused when it is compiled, wherever the name hides; :func:`check_template` renders a
sample conversation with tools and calls before one is accepted, saying what went wrong when it fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from importlib import resources
from typing import Any, ClassVar

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser

from app.tool_calls.render_deadline import RenderDeadlineError, charge, run_with_deadline
from app.tool_calls.template_sandbox import BoundedSandboxedEnvironment
from app.tool_calls.template_sizes import MAX_VALUE_SIZE, TemplateBoundError

MAX_TEMPLATE_CHARS = 64 * 1024  # the largest Hugging Face chat templates are ~20k characters
MAX_RENDERED_CHARS = MAX_VALUE_SIZE  # a prompt past 4 MiB fits no context this server serves
MAX_RENDER_SECONDS = 1.0  # real templates render in milliseconds (docs/tools.md has the figures)
SHIPPED_TEMPLATE = "chatml_tools.jinja"
MAX_ERROR_CHARS = 512  # of an error's text in a refusal: raise_exception's message is the template's to choose
MAX_STRFTIME_CHARS = 256  # strftime_now's format: "%d %b %Y" is what templates pass; "%c" writes 24 characters

SAMPLE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
SAMPLE_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C, sunny"},
    {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
    {"role": "user", "content": "And in Rome?"},
]


# What a template sees for the tokenizer's special tokens when no tokenizer is at hand (the sample renders that check
# a template): a template that writes them or adds them to text still renders.
NO_SPECIAL_TOKENS: Mapping[str, str] = {"bos_token": "", "eos_token": ""}


class ChatTemplateError(ValueError):
    """A chat template that cannot be compiled or rendered; the message says why."""


class _RenderedTooLongError(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _shown(error: BaseException) -> str:
    text = str(error)
    return text if len(text) <= MAX_ERROR_CHARS else f"{text[:MAX_ERROR_CHARS]}… ({len(text)} characters)"


def _strftime_now(fmt: Any) -> str:
    text = str(fmt)
    if len(text) > MAX_STRFTIME_CHARS:
        raise TemplateBoundError(f"strftime_now takes a format of at most {MAX_STRFTIME_CHARS} characters")
    return datetime.now(UTC).strftime(text)


class _GenerationBlocks(Extension):
    """``{% generation %}...{% endgeneration %}``, which transformers' templates use to mark the assistant's text for
    training masks: what is inside renders as it is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _environment() -> BoundedSandboxedEnvironment:
    """Jinja as transformers sets it up for chat templates (blocks trimmed, ``break`` and ``continue``, the
    ``generation`` block), in the bounded sandbox."""
    environment = BoundedSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, autoescape=False, extensions=[loopcontrols, _GenerationBlocks]
    )
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


def _check_names(environment: BoundedSandboxedEnvironment, source: str) -> None:
    """ChatTemplateError naming the first filter, test or function the template uses and is not offered."""
    tree = environment.parse(source)
    for node in tree.find_all((nodes.Filter, nodes.Test)):
        offered = environment.filters if isinstance(node, nodes.Filter) else environment.tests
        if node.name not in offered:
            kind = "filter" if isinstance(node, nodes.Filter) else "test"
            raise ChatTemplateError(
                f"the chat template uses the {kind} `{node.name}` (line {node.lineno}), which chat templates are "
                f"not offered; these are: {', '.join(sorted(offered))}"
            )
    declared = {macro.name for macro in tree.find_all(nodes.Macro)}  # anywhere: a macro in an `if` calls itself
    declared |= {name.name for name in tree.find_all(nodes.Name) if name.ctx in ("store", "param")}
    undeclared = meta.find_undeclared_variables(tree) - declared
    for call in tree.find_all(nodes.Call):
        name = call.node.name if isinstance(call.node, nodes.Name) else None
        if name in undeclared and name not in environment.globals:
            raise ChatTemplateError(
                f"the chat template calls `{name}` (line {call.lineno}), a function chat templates are not offered; "
                f"these are: {', '.join(sorted(environment.globals))}"
            )


class ChatTemplate:
    """A compiled chat template."""

    def __init__(self, source: str, *, max_render_seconds: float | None = MAX_RENDER_SECONDS) -> None:
        """``max_render_seconds``: None for the server's own templates, which render untraced (~2.7x faster)."""
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(
                f"the chat template has {len(source)} characters; at most {MAX_TEMPLATE_CHARS} are taken"
            )
        if not source.strip():
            raise ChatTemplateError("the chat template is empty")
        environment = _environment()
        try:
            _check_names(environment, source)
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(
                f"the chat template is not valid Jinja (line {error.lineno}: {error.message})"
            ) from None
        self.source = source
        self.max_render_seconds = max_render_seconds

    @classmethod
    def shipped(cls) -> ChatTemplate:
        """The shipped ChatML template that renders tools and calls in the hermes format."""
        source = resources.files(__package__).joinpath("templates", SHIPPED_TEMPLATE).read_text(encoding="utf-8")
        return cls(source, max_render_seconds=None)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        special_tokens: Mapping[str, str] = NO_SPECIAL_TOKENS,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text; ChatTemplateError if the template fails on this conversation.

        ``special_tokens``: the model's tokenizer's named special tokens (``bos_token``, ``eos_token``, ...), which
        the template sees as transformers' ``apply_chat_template`` shows them; it writes them itself, so the text is
        encoded without adding any.
        """
        context = {
            **special_tokens,
            "messages": messages,
            "tools": tools or None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            if self.max_render_seconds is None:
                return self._generate(context)
            return run_with_deadline(lambda: self._generate(context), self.max_render_seconds)
        except RenderDeadlineError:
            raise ChatTemplateError(
                f"the chat template ran longer than {self.max_render_seconds:g} s on this conversation, the most one "
                "render may take"
            ) from None
        except _RenderedTooLongError:
            raise ChatTemplateError(f"the chat template rendered more than {MAX_RENDERED_CHARS} characters") from None
        except TemplateBoundError as error:
            raise ChatTemplateError(f"the chat template went past a bound: {error}") from None
        except jinja2.exceptions.SecurityError as error:
            raise ChatTemplateError(f"the chat template did something the sandbox forbids: {_shown(error)}") from None
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template failed: {_shown(error)}") from None
        except (
            TypeError,
            ValueError,
            AttributeError,
            KeyError,
            IndexError,
            ZeroDivisionError,
            AssertionError,
            RecursionError,
            OverflowError,
            MemoryError,
        ) as error:
            raise ChatTemplateError(f"the chat template failed: {type(error).__name__}: {_shown(error)}") from None

    def _generate(self, context: dict[str, Any]) -> str:
        parts: list[str] = []
        size = 0
        for part in self._template.generate(**context):
            size += len(part)
            if size > MAX_RENDERED_CHARS:
                raise _RenderedTooLongError
            charge(len(part), "the output")
            parts.append(part)
        return "".join(parts)


def check_template(source: str, *, max_render_seconds: float | None = MAX_RENDER_SECONDS) -> ChatTemplate:
    """``source`` compiled, once it has rendered a sample conversation with tools, a call and its result.

    ChatTemplateError says why it is refused: it does not compile, fails on the sample, or renders
    neither the tools nor the call (a template that drops them would leave the model blind to its tools).
    """
    template = ChatTemplate(source, max_render_seconds=max_render_seconds)
    rendered = template.render(SAMPLE_MESSAGES, SAMPLE_TOOLS)
    for needle, what in (("get_weather", "the tools and calls"), ("18 C, sunny", "the tool's result")):
        if needle not in rendered:
            raise ChatTemplateError(
                f"the chat template does not render {what} (a sample conversation showed no {needle!r})"
            )
    return template
