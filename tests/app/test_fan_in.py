"""Several engine streams merged as they arrive: every output once, the first failure ends the merge, and leaving
early closes every stream (which is how the engine hears to abort them)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from app.openai.chat.fan_in import fan_in
from engine import RequestOutput
from engine.errors import RequestError

pytestmark = pytest.mark.anyio


def _output(request_id: str, num_tokens: int) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=[1],
        token_ids=list(range(num_tokens)),
        text="x" * num_tokens,
        delta_token_ids=[num_tokens - 1],
        delta_text="x",
        finish_reason=None,
        num_cached_tokens=0,
        ttft_s=None,
    )


class Stream:
    """``num_outputs`` outputs a ``delay_s`` apart, then a failure or the end; remembers whether it was closed."""

    def __init__(self, name: str, num_outputs: int, delay_s: float, fail: bool = False) -> None:
        self.name, self.num_outputs, self.delay_s, self.fail = name, num_outputs, delay_s, fail
        self.closed = False

    async def run(self) -> AsyncIterator[RequestOutput]:
        try:
            for i in range(1, self.num_outputs + 1):
                await asyncio.sleep(self.delay_s)
                yield _output(self.name, i)
            if self.fail:
                raise RequestError(f"{self.name} failed")
        finally:
            self.closed = True


async def test_every_output_arrives_once_tagged_with_its_stream() -> None:
    streams = [Stream("a", 3, 0.003), Stream("b", 5, 0.001)]
    seen = [(i, output.request_id, len(output.token_ids)) async for i, output in fan_in([s.run() for s in streams])]
    assert sorted(seen) == [(0, "a", 1), (0, "a", 2), (0, "a", 3), *((1, "b", k) for k in range(1, 6))]
    assert seen[0][1] == "b"  # as they arrive, not stream by stream
    assert all(stream.closed for stream in streams)


async def test_a_failure_ends_the_merge_and_closes_the_others() -> None:
    slow, failing = Stream("slow", 1000, 0.01), Stream("failing", 2, 0.001, fail=True)
    with pytest.raises(RequestError, match="failing failed"):
        async for _ in fan_in([slow.run(), failing.run()]):
            pass
    assert slow.closed and failing.closed


async def test_leaving_early_closes_every_stream() -> None:
    streams = [Stream("a", 1000, 0.005), Stream("b", 1000, 0.005)]
    async with contextlib.aclosing(fan_in([s.run() for s in streams])) as merged:
        async for _ in merged:
            break
    assert all(stream.closed for stream in streams)
