"""The OpenAI endpoints' logic: validate, resolve the model, run it metered, shape the response."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from app.adapters.resolver import ModelResolver, ResolvedModel
from app.engine_clients.interface import EngineClient
from app.keys.authenticator import Principal
from app.limits.limiter import Limiter
from app.observability.metrics import GatewayMetrics
from app.openai.chat import params as request_params
from app.openai.chat import replies, streams
from app.openai.chat.prompts import Prompt, chat_prompt_ids, completion_prompts
from app.openai.chat.replies import Reply
from app.openai.chat.reply_schemas import ChatCompletion, Completion, ModelCard, ModelList
from app.openai.chat.request_schemas import ChatCompletionRequest, CompletionRequest
from app.openai.chat.runs import Run, Submission, metered_outputs
from app.openai.chat.structured import output_constraint
from app.openai.chat.styles import ChatStyles
from app.openai.chat.unsupported import refuse_unsupported_chat, refuse_unsupported_completion
from app.settings_defaults import DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS, DEFAULT_TOOL_CALL_FORMAT
from app.tool_calls.style import ChatStyle, base_chat_style
from app.usage.writer import UsageWriter
from app.web.errors import BadRequestError, ModelNotFoundError, ServiceUnavailableError
from engine import GrammarConstraint, GrammarError, RequestOutput
from engine.errors import EngineDeadError, RequestError, UnknownAdapterError

OWNED_BY_SYSTEM = "loraplex"

Choices = AsyncIterator[tuple[int, RequestOutput]]


@dataclass(slots=True)
class OpenAIService:
    engine: EngineClient
    resolver: ModelResolver
    writer: UsageWriter
    metrics: GatewayMetrics
    limiter: Limiter
    max_n: int = DEFAULT_MAX_N
    max_prompts: int = DEFAULT_MAX_PROMPTS
    base_style: ChatStyle = field(default_factory=lambda: base_chat_style(None, DEFAULT_TOOL_CALL_FORMAT))
    share_base_prefix_cache: bool = False
    """Base-model requests of every tenant share cached prefixes (LORAPLEX_SHARE_BASE_PREFIX_CACHE); else
    each tenant's requests reuse only its own (docs/operating.md#security)."""
    styles: ChatStyles = field(init=False)

    def __post_init__(self) -> None:
        self.styles = ChatStyles(self.base_style, self.resolver.chat_template)

    async def models(self, principal: Principal) -> ModelList:
        base = self.engine.model_name
        cards = [ModelCard(id=base, created=0, owned_by=OWNED_BY_SYSTEM)]
        for name, created in await self.resolver.list_adapter_names(principal.tenant_id):
            cards.append(ModelCard(id=name, created=created, owned_by=principal.tenant_name, parent=base))
        return ModelList(data=cards)

    async def chat(
        self, principal: Principal, body: ChatCompletionRequest, request_id: str
    ) -> ChatCompletion | AsyncIterator[bytes]:
        refuse_unsupported_chat(body)
        reply, first, outputs = await self.start_chat(principal, body, request_id, "chat.completions", "chatcmpl-")
        if body.stream:
            return streams.chat_stream(reply, first, outputs)
        return replies.chat_completion(reply, await last_outputs(first, outputs, body.model))

    async def start_chat(
        self, principal: Principal, body: ChatCompletionRequest, request_id: str, endpoint: str, id_prefix: str
    ) -> tuple[Reply, tuple[int, RequestOutput], Choices]:
        """Run a chat completion metered as ``endpoint``: its reply, first output and the stream of the rest."""
        constraint, plan, param = output_constraint(body, self.base_style.tool_format)  # bad tools: 400 first
        model = await self.resolver.resolve(principal.tenant_id, body.model)
        style = await self.styles.style(model)
        if plan is not None and plan.tool_format not in (None, style.tool_format):
            constraint, plan, param = output_constraint(body, style.tool_format)
        prompts = [Prompt(await chat_prompt_ids(body, self.engine, style, plan))]
        first, outputs = await self._start(principal, body, prompts, request_id, endpoint, constraint, param, model)
        reply = replace(self._reply(f"{id_prefix}{request_id}", body, prompts), tool_plan=plan)
        return reply, first, outputs

    async def completion(
        self, principal: Principal, body: CompletionRequest, request_id: str
    ) -> Completion | AsyncIterator[bytes]:
        refuse_unsupported_completion(body)
        constraint, _, param = output_constraint(body, self.base_style.tool_format)
        prompts = await completion_prompts(body, self.engine, self.max_prompts)
        first, outputs = await self._start(principal, body, prompts, request_id, "completions", constraint, param)
        reply = self._reply(f"cmpl-{request_id}", body, prompts)
        if body.stream:
            return streams.completion_stream(reply, first, outputs)
        return replies.completion(reply, await last_outputs(first, outputs, body.model))

    def _reply(self, reply_id: str, body: ChatCompletionRequest | CompletionRequest, prompts: list[Prompt]) -> Reply:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        shown = request_params.shown(body)
        return Reply(reply_id, int(time.time()), body.model, shown, prompts, self.engine, include_usage)

    async def _start(
        self,
        principal: Principal,
        body: ChatCompletionRequest | CompletionRequest,
        prompts: list[Prompt],
        request_id: str,
        endpoint: str,
        constraint: GrammarConstraint | None = None,
        constraint_param: str = "",
        model: ResolvedModel | None = None,
    ) -> tuple[tuple[int, RequestOutput], Choices]:
        """Resolve (unless ``model`` is), check, admit and submit the run; its first output and the rest's stream."""
        run = await self._prepare(principal, body, prompts, request_id, endpoint, constraint, constraint_param, model)
        outputs = metered_outputs(run, self.engine, self.writer, self.metrics)
        try:
            return await _first_output(outputs, body.model), outputs
        except BaseException:
            run.admission.settle(0)  # the stream settles once started; this covers one that never started
            raise

    async def _prepare(
        self,
        principal: Principal,
        body: ChatCompletionRequest | CompletionRequest,
        prompts: list[Prompt],
        request_id: str,
        endpoint: str,
        constraint: GrammarConstraint | None,
        constraint_param: str,
        model: ResolvedModel | None,
    ) -> Run:
        if not self.engine.is_ready():
            raise ServiceUnavailableError("The model is still loading; retry in a few seconds.")
        self.writer.check_room()  # a request whose usage could not be kept is not served
        if model is None:
            model = await self.resolver.resolve(principal.tenant_id, body.model)
        limits = request_params.Limits(self.engine.max_model_len, self.engine.vocab_size, self.max_n)
        prompt_lens = [len(prompt.token_ids) for prompt in prompts]
        params = request_params.sampling_params(
            body, prompt_lens, limits, constraint, self._cache_salt(principal, model)
        )
        if constraint is not None:  # compiled off the loop before admission: a bad schema costs no quota
            try:
                await self.engine.check_constraint(constraint)
            except GrammarError as error:
                raise BadRequestError(f"`{constraint_param}`: {error}.", param=constraint_param) from None
        num_prompt_tokens = sum(len(prompt.token_ids) for prompt in prompts)
        num_completion_tokens = sum(p.n * p.max_tokens for p in params)  # every choice may run to max_tokens
        admission = await self.limiter.admit(principal, num_prompt_tokens, num_completion_tokens)
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        triples = zip(ids, prompts, params, strict=True)
        submissions = tuple(Submission(engine_id, prompt.token_ids, p) for engine_id, prompt, p in triples)
        return Run(request_id, endpoint, principal, model, submissions, admission)

    def _cache_salt(self, principal: Principal, model: ResolvedModel) -> str | None:
        """The tenant's id, so that its cached prefixes are its own; None shares base-model prefixes when allowed."""
        if self.share_base_prefix_cache and model.adapter_id is None:
            return None
        return str(principal.tenant_id)


async def _first_output(outputs: Choices, model: str) -> tuple[int, RequestOutput]:
    """The run's first output, so that a request the engine refuses gets a 4xx before any byte is sent."""
    try:
        return await anext(outputs)
    except BaseException as error:
        raise _api_error(error, model) from None


async def last_outputs(first: tuple[int, RequestOutput], outputs: Choices, model: str) -> dict[int, RequestOutput]:
    """Each choice's last output, once every choice has finished."""
    index, output = first
    last = {index: output}
    try:
        async for index, output in outputs:
            last[index] = output
    except BaseException as error:
        raise _api_error(error, model) from None
    return last


def _api_error(error: BaseException, model: str) -> BaseException:
    """What the client is told about an engine error (others as they are)."""
    if isinstance(error, UnknownAdapterError):  # the adapter was removed between resolution and admission
        return ModelNotFoundError(model)
    if isinstance(error, RequestError):
        return BadRequestError(str(error))
    if isinstance(error, EngineDeadError):
        return ServiceUnavailableError(f"The engine stopped: {error}. Retry later.")
    return error
