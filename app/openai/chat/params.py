"""From an OpenAI request body to the engine's sampling params, and what the response must show.

Every check here answers 400 with the parameter's name and the range it takes, before the request
reaches the limiter or the engine (the engine checks the same bounds again, as its own contract).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.openai.chat.prompts import ContextLengthError
from app.openai.chat.request_schemas import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_SEQUENCES,
    ChatCompletionRequest,
    CompletionRequest,
)
from app.web.errors import BadRequestError
from engine import GrammarConstraint, RequestError, SamplingParams

Body = ChatCompletionRequest | CompletionRequest
MAX_TOKEN_ID_DIGITS = 10  # token ids are int32 in the engine


@dataclass(frozen=True, slots=True)
class Limits:
    """The model's and the server's bounds a request is checked against."""

    max_model_len: int
    vocab_size: int
    max_n: int


@dataclass(frozen=True, slots=True)
class Shown:
    """What the response shows besides each choice's text."""

    n: int = 1
    """Choices per prompt."""
    logprobs: int | None = None
    """Alternatives per generated token; None: no logprobs."""
    echo: bool = False
    """The prompt comes before each choice's text (completions)."""
    echo_logprobs: int | None = None
    """With ``echo``, alternatives per prompt token in the choice's logprobs; None: none."""
    prompt_logprobs: int | None = None
    """vLLM's ``prompt_logprobs``: alternatives per prompt token in its own field; None: the field is left out."""


def shown(body: Body) -> Shown:
    """What ``body`` asks the response to show (its values are checked by :func:`sampling_params`)."""
    n = 1 if body.n is None else body.n
    if isinstance(body, ChatCompletionRequest):
        return Shown(n=n, logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    echo = bool(body.echo)
    return Shown(
        n=n,
        logprobs=body.logprobs,
        echo=echo,
        echo_logprobs=body.logprobs if echo else None,
        prompt_logprobs=body.prompt_logprobs,
    )


def sampling_params(
    body: Body,
    prompt_lens: list[int],
    limits: Limits,
    constraint: GrammarConstraint | None = None,
    cache_salt: str | None = None,
) -> list[SamplingParams]:
    """The engine's sampling params for each prompt (they differ only in ``max_tokens`` when it defaults)."""
    _check_choices(body, limits.max_n)
    _check_logprobs(body)
    if body.stream_options is not None and not body.stream:
        raise BadRequestError("`stream_options` is only allowed when `stream` is true.", param="stream_options")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > MAX_STOP_SEQUENCES:
        raise BadRequestError(f"`stop` takes at most {MAX_STOP_SEQUENCES} sequences.", param="stop")
    if not all(stop):
        raise BadRequestError(
            "`stop` sequences must not be empty; leave out `stop` to stop only at the end.", param="stop"
        )
    if body.seed is not None and not -MAX_SEED <= body.seed <= MAX_SEED:
        raise BadRequestError("`seed` must fit in a signed 64-bit integer.", param="seed")
    _check_ranges(body)
    what = shown(body)
    fields: dict[str, object] = {
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": 0 if body.top_k is None or body.top_k == -1 else min(body.top_k, limits.vocab_size),
        "min_p": body.min_p or 0.0,
        "seed": None if body.seed is None else abs(body.seed),
        "stop": stop,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
        "logit_bias": _logit_bias(body.logit_bias, limits.vocab_size),
        "stop_token_ids": _stop_token_ids(body.stop_token_ids, limits.vocab_size),
        "ignore_eos": bool(body.ignore_eos),
        "speculate": body.speculative is not False,
        "logprobs": what.logprobs,
        "n": what.n,
        "constraint": constraint,
        "cache_salt": cache_salt,
    }
    params = [_with_max_tokens(body, num_prompt, limits.max_model_len, fields) for num_prompt in prompt_lens]
    try:
        return [SamplingParams(**p) for p in params]  # type: ignore[arg-type]  # the fields above, typed
    except RequestError as error:
        raise BadRequestError(str(error)) from None


def _with_max_tokens(
    body: Body, num_prompt_tokens: int, max_model_len: int, fields: dict[str, object]
) -> dict[str, object]:
    max_tokens, param = body.max_tokens, "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        max_tokens = room  # as vLLM: whatever room the context leaves
    scores_prompt = isinstance(body, CompletionRequest) and (body.echo or body.prompt_logprobs is not None)
    if max_tokens < 0 or (max_tokens == 0 and not scores_prompt):
        least = "at least 1 (or 0 with `echo` or `prompt_logprobs`, to score the prompt)"
        raise BadRequestError(f"`{param}` must be {least}, got {max_tokens}.", param=param)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the length of the prompt or `{param}`.",
            param=param if room > 0 else "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
        )
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        raise BadRequestError(
            f"`min_tokens` must be within [0, {param}] ([0, {max_tokens}] here), got {min_tokens}.", param="min_tokens"
        )
    return {**fields, "max_tokens": max_tokens, "min_tokens": min_tokens, "prompt_logprobs": _prompt_logprobs(body)}


def _prompt_logprobs(body: Body) -> int | None:
    """What the engine scores of the prompt: the most alternatives that ``echo`` or ``prompt_logprobs`` want."""
    if not isinstance(body, CompletionRequest):
        return None
    wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    if wanted:
        return max(wanted)
    return 0 if body.echo and body.max_tokens == 0 else None  # echo alone needs no scores, unless nothing is generated


def _check_choices(body: Body, max_n: int) -> None:
    n = 1 if body.n is None else body.n
    if not 1 <= n <= max_n:
        raise BadRequestError(f"`n` must be within [1, {max_n}], got {n}.", param="n")
    if body.best_of is not None and body.best_of != n:
        raise BadRequestError(
            f"`best_of` must be null or equal to `n` ({n}): choosing the best of more candidates is not offered.",
            param="best_of",
        )
    if body.use_beam_search:
        raise BadRequestError("Beam search is not offered; leave out `use_beam_search`.", param="use_beam_search")


def _check_logprobs(body: Body) -> None:
    name = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
    value = body.top_logprobs if isinstance(body, ChatCompletionRequest) else body.logprobs
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise BadRequestError(f"`{name}` must be within [0, {MAX_LOGPROBS}], got {value}.", param=name)
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise BadRequestError("`top_logprobs` is only allowed when `logprobs` is true.", param="top_logprobs")
    scored = body.prompt_logprobs if isinstance(body, CompletionRequest) else None
    if scored is not None and not 0 <= scored <= MAX_LOGPROBS:
        raise BadRequestError(
            f"`prompt_logprobs` must be within [0, {MAX_LOGPROBS}], got {scored}.", param="prompt_logprobs"
        )


def _check_ranges(body: Body) -> None:
    """Each numeric parameter within its range: ``[low, high]``, or ``(low, high]`` where ``low`` is excluded."""
    checks: tuple[tuple[str, float | None, float, float, bool], ...] = (
        ("temperature", body.temperature, 0.0, 2.0, False),
        ("top_p", body.top_p, 0.0, 1.0, True),
        ("min_p", body.min_p, 0.0, 1.0, False),
        ("presence_penalty", body.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY, False),
        ("frequency_penalty", body.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY, False),
        ("repetition_penalty", body.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, True),
    )
    for name, value, low, high, low_excluded in checks:
        if value is None:
            continue
        if not low <= value <= high or (low_excluded and value == low):
            interval = f"({low:g}, {high:g}]" if low_excluded else f"[{low:g}, {high:g}]"
            raise BadRequestError(f"`{name}` must be within {interval}, got {value}.", param=name)
    if body.top_k is not None and body.top_k < -1:
        raise BadRequestError(
            f"`top_k` must be -1 or 0 (keep every token) or a positive count, got {body.top_k}.", param="top_k"
        )
    if body.min_tokens is not None and body.min_tokens < 0:
        raise BadRequestError(f"`min_tokens` must be at least 0, got {body.min_tokens}.", param="min_tokens")


def _logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not logit_bias:
        return ()
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise BadRequestError(
            f"`logit_bias` takes at most {MAX_LOGIT_BIAS} entries, got {len(logit_bias)}.", param="logit_bias"
        )
    pairs = []
    for key, bias in logit_bias.items():
        # A short decimal string only: int() of thousands of digits raises (Python's conversion limit).
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS else -1
        if not 0 <= token < vocab_size:
            raise BadRequestError(
                f"`logit_bias` keys must be token ids within [0, {vocab_size}) written as strings, got {key!r}.",
                param="logit_bias",
            )
        if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
            raise BadRequestError(
                f"`logit_bias` values must be within [-100, 100], got {bias} for token {key}.", param="logit_bias"
            )
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


def _stop_token_ids(token_ids: list[int] | None, vocab_size: int) -> tuple[int, ...]:
    if any(not 0 <= token < vocab_size for token in token_ids or ()):
        raise BadRequestError(f"`stop_token_ids` must be token ids within [0, {vocab_size}).", param="stop_token_ids")
    return tuple(token_ids or ())
