"""The answer to one request, whole or as chunks: its choices in OpenAI's shapes, and its usage.

A :class:`Reply` holds what every body or chunk of one answer shares; ``choice`` indices are OpenAI's
(prompt-major, then ``n``: choice ``i`` answers prompt ``i // n``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.engine_clients.interface import EngineClient
from app.openai.chat import logprobs as shaping
from app.openai.chat.params import Shown
from app.openai.chat.prompts import Prompt
from app.openai.chat.reply_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Usage,
)
from app.openai.chat.runs import num_cached_prompt_tokens
from app.openai.chat.tools import ToolPlan
from engine import RequestOutput
from engine.sampling.logprobs import TokenLogprob


@dataclass(frozen=True, slots=True)
class Reply:
    """One answer's id, time and model, what it must show, and the prompts it answers."""

    id: str
    created: int
    model: str
    shown: Shown
    prompts: list[Prompt]
    engine: EngineClient
    include_usage: bool = False
    tool_plan: ToolPlan | None = None  # chat whose answer is tool calls

    def prompt_of(self, choice: int) -> Prompt:
        return self.prompts[choice // self.shown.n]

    def echo_text(self, choice: int) -> str:
        """The prompt as sent (a text), or its tokens' text (token ids), when ``echo`` is asked; else nothing."""
        if not self.shown.echo:
            return ""
        prompt = self.prompt_of(choice)
        return prompt.text if prompt.text is not None else self.engine.decode(prompt.token_ids)

    def usage(self, last: dict[int, RequestOutput]) -> Usage:
        """Every prompt once, every choice's completion, and the prompts' cached tokens (the usage row's counts)."""
        num_prompt = sum(len(prompt.token_ids) for prompt in self.prompts)
        num_completion = sum(len(output.token_ids) for output in last.values())
        return Usage(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details={"cached_tokens": num_cached_prompt_tokens(last, self.shown.n)},
        )

    def chat_logprobs(self, output: RequestOutput, *, delta: bool) -> ChatLogprobs | None:
        if self.shown.logprobs is None:
            return None
        entries = shaping.delta_logprobs(output) if delta else shaping.all_logprobs(output)
        return shaping.chat_logprobs(entries, self.shown.logprobs, self.engine)


def chat_completion(reply: Reply, last: dict[int, RequestOutput]) -> ChatCompletion:
    choices = []
    for index, output in sorted(last.items()):
        message, finish_reason = assistant_message(reply.tool_plan, output)
        logprobs = reply.chat_logprobs(output, delta=False)
        choices.append(ChatChoice(index=index, message=message, finish_reason=finish_reason, logprobs=logprobs))
    usage = reply.usage(last)
    return ChatCompletion(id=reply.id, created=reply.created, model=reply.model, choices=choices, usage=usage)


def assistant_message(plan: ToolPlan | None, output: RequestOutput) -> tuple[AssistantMessage, str | None]:
    """A choice's message and finish reason: its text, or its tool calls (``auto``: and the text before them).

    A call cut by ``max_tokens`` is not a call: its text comes back as content, with finish reason ``length``.
    """
    if plan is not None and plan.is_auto:
        content, auto_calls, finish_reason = plan.answer(output.text, output.finish_reason)
        return AssistantMessage(role="assistant", content=content, tool_calls=auto_calls), finish_reason
    calls = plan.calls(output.text) if plan is not None and output.finish_reason == "stop" else None
    if plan is None or calls is None:
        return AssistantMessage(role="assistant", content=output.text), output.finish_reason
    return AssistantMessage(role="assistant", content=None, tool_calls=calls), plan.finish_reason


def completion(reply: Reply, last: dict[int, RequestOutput]) -> Completion:
    choices = [CompletionPiece(reply, index).whole(output) for index, output in sorted(last.items())]
    usage = reply.usage(last)
    return Completion(id=reply.id, created=reply.created, model=reply.model, choices=choices, usage=usage)


class CompletionPiece:
    """One completions choice, whole or chunk by chunk: the echoed prompt (with its logprobs) comes first."""

    def __init__(self, reply: Reply, index: int) -> None:
        self.reply = reply
        self.index = index
        self._shaper = shaping.CompletionLogprobsShaper(reply.engine) if self._wants_logprobs else None
        self._started = False

    @property
    def _wants_logprobs(self) -> bool:
        shown = self.reply.shown
        return shown.logprobs is not None or shown.echo_logprobs is not None

    def whole(self, output: RequestOutput) -> CompletionChoice:
        return self._choice(output, output.text, shaping.all_logprobs(output), output.finish_reason)

    def chunk(self, output: RequestOutput) -> CompletionChoice | None:
        """The choice's part in a chunk for ``output``; None when there is nothing new to send."""
        if self._started and not output.delta_text and not output.finished and not self._delta_scores(output):
            return None
        return self._choice(output, output.delta_text, shaping.delta_logprobs(output), output.finish_reason)

    def _delta_scores(self, output: RequestOutput) -> bool:
        return self.reply.shown.logprobs is not None and bool(output.delta_token_ids)

    def _choice(
        self, output: RequestOutput, text: str, entries: Sequence[TokenLogprob], finish_reason: str | None
    ) -> CompletionChoice:
        shown, first = self.reply.shown, not self._started
        self._started = True
        echo = self.reply.echo_text(self.index) if first else ""
        logprobs: CompletionLogprobs | None = None
        if self._shaper is not None:
            logprobs = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
            if first and shown.echo_logprobs is not None:
                ids = self.reply.prompt_of(self.index).token_ids
                logprobs = self._shaper.prompt(ids, output.prompt_logprobs, shown.echo_logprobs, echo)
            if shown.logprobs is not None:
                logprobs = shaping.joined(logprobs, self._shaper.generated(entries, shown.logprobs))
        scores = None
        if first and shown.prompt_logprobs is not None:
            scores = shaping.prompt_logprobs(output.prompt_logprobs, shown.prompt_logprobs, self.reply.engine)
        return CompletionChoice(
            index=self.index, text=echo + text, finish_reason=finish_reason, logprobs=logprobs, prompt_logprobs=scores
        )
