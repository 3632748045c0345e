"""A failure inside one sequence's step fails that request only; the others finish as if it never ran."""

import asyncio
from pathlib import Path

import pytest

from engine import Engine, RequestFailedError, SamplingParams
from engine.drivers.async_engine import AsyncEngine
from engine.memory.page_pool import OwnerKind
from engine.scheduling.sequence import Sequence
from tests.engine.conftest import make_engine

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paged attention keeps"]
POISON = [7, 7, 7, 7, 7, 7, 7, 7, 7]  # a prompt the faulty parts below recognise
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


class InjectedFault(RuntimeError):
    pass


def _poison_the_forward(engine: Engine) -> None:
    """The model raises on any batch that holds a token of the poisoned prompt (as a kernel fault would)."""
    forward = engine.model.forward

    def faulty(batch, pool):
        if (batch.input_ids == POISON[0]).any():
            raise InjectedFault("a fault in the forward pass")
        return forward(batch, pool)

    engine.model.forward = faulty


def _kv_pages(engine: Engine) -> int:
    return engine.pool.stats().pages_by_owner.get(OwnerKind.KV.value, 0)


def test_a_forward_fault_fails_only_the_request_it_belongs_to(tiny_llama: Path) -> None:
    expected = [out.token_ids for out in make_engine(tiny_llama).generate(PROMPTS, PARAMS)]
    engine = make_engine(tiny_llama)
    _poison_the_forward(engine)

    finals = engine.generate([PROMPTS[0], POISON, PROMPTS[1], PROMPTS[2]], PARAMS)

    poisoned = finals[1]
    assert poisoned.finish_reason == "error"
    assert poisoned.error is not None and "InjectedFault: a fault in the forward pass" in poisoned.error
    assert poisoned.token_ids == []
    assert [out.token_ids for out in (finals[0], *finals[2:])] == expected
    assert all(out.finish_reason == "length" for out in (finals[0], *finals[2:]))
    assert not engine.has_unfinished_requests() and _kv_pages(engine) == 0


def test_a_fault_while_appending_a_token_fails_only_that_request(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = [out.token_ids for out in make_engine(tiny_llama).generate(PROMPTS, PARAMS)]
    append_token = Sequence.append_token

    def faulty(seq: Sequence, token_id: int) -> str:
        if seq.prompt_token_ids == POISON and seq.num_output_tokens == 3:
            raise InjectedFault("a fault in a stop check")
        return append_token(seq, token_id)

    monkeypatch.setattr(Sequence, "append_token", faulty)
    engine = make_engine(tiny_llama)

    finals = engine.generate([PROMPTS[0], PROMPTS[1], POISON, PROMPTS[2]], PARAMS)

    assert finals[2].finish_reason == "error" and len(finals[2].token_ids) == 3, "what it generated is reported"
    assert [out.token_ids for out in (*finals[:2], finals[3])] == expected
    assert not engine.has_unfinished_requests() and _kv_pages(engine) == 0


def test_the_async_engine_raises_for_the_failed_request_and_keeps_serving(tiny_llama: Path) -> None:
    sync_engine = make_engine(tiny_llama)
    _poison_the_forward(sync_engine)

    async def consume(engine: AsyncEngine, prompt: str | list[int]) -> list[int]:
        tokens: list[int] = []
        async for output in engine.generate(prompt, PARAMS):
            tokens += output.delta_token_ids
        return tokens

    async def main() -> list[list[int] | BaseException]:
        engine = AsyncEngine(sync_engine)
        engine.start()
        try:
            results = await asyncio.gather(
                *(consume(engine, prompt) for prompt in [PROMPTS[0], POISON, PROMPTS[1]]), return_exceptions=True
            )
            results.append(await consume(engine, PROMPTS[2]))  # the step loop is still alive afterwards
            return results
        finally:
            await engine.stop()

    first, poisoned, second, after = asyncio.run(main())
    assert isinstance(poisoned, RequestFailedError) and "InjectedFault" in str(poisoned)
    assert all(isinstance(tokens, list) and len(tokens) == PARAMS.max_tokens for tokens in (first, second, after))
