"""The asyncio form of the engine: concurrent streams, early exits that abort, a clean stop."""

import asyncio
import threading
from pathlib import Path

import pytest

from engine import EngineConfig, GrammarConstraint, RequestError, SamplingParams
from engine.drivers.async_engine import AsyncEngine
from engine.errors import ConfigError, EngineDeadError
from engine.memory.page_pool import OwnerKind
from tests.engine.conftest import make_engine
from tests.engine.engine_threads import default_model_config, record_engine_threads

PROMPTS = ["The quick brown fox", "def add(a, b):", "Bonjour, ça va?", "Paged attention keeps"]


def test_concurrent_streams_match_the_blocking_api(tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = make_engine(tiny_llama).generate(PROMPTS, params)

    async def consume(engine: AsyncEngine, prompt: str) -> tuple[list[int], str, str | None]:
        tokens, text, reason = [], "", None
        async for output in engine.generate(prompt, params):
            tokens += output.delta_token_ids
            text += output.delta_text
            reason = output.finish_reason
        return tokens, text, reason

    async def main() -> list[tuple[list[int], str, str | None]]:
        engine = AsyncEngine(make_engine(tiny_llama))
        engine.start()
        try:
            return await asyncio.gather(*(consume(engine, p) for p in PROMPTS))
        finally:
            await engine.stop()

    results = asyncio.run(main())
    for (tokens, text, reason), want in zip(results, expected, strict=True):
        assert tokens == want.token_ids
        assert text == want.text
        assert reason == "length"


def test_leaving_the_stream_early_aborts_and_frees_pages(tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        sync_engine = make_engine(tiny_llama)
        engine = AsyncEngine(sync_engine)
        engine.start()
        try:
            seen = 0
            async for _ in engine.generate(PROMPTS[0], params):
                seen += 1
                if seen == 3:
                    break
            for _ in range(100):
                await asyncio.sleep(0.01)
                if not sync_engine.has_unfinished_requests():
                    break
            assert not sync_engine.has_unfinished_requests()
            assert sync_engine.pool.stats().pages_by_owner[OwnerKind.KV.value] == 0
        finally:
            await engine.stop()

    asyncio.run(main())


def test_bad_request_raises_in_the_caller(tiny_llama: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(make_engine(tiny_llama))
        engine.start()
        try:
            with pytest.raises(RequestError, match="empty"):
                async for _ in engine.generate([], SamplingParams()):
                    pass
        finally:
            await engine.stop()

    asyncio.run(main())


def test_stop_ends_streams_in_flight_with_abort(tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def main() -> str | None:
        engine = AsyncEngine(make_engine(tiny_llama))
        engine.start()
        reason = None

        async def consume() -> None:
            nonlocal reason
            async for output in engine.generate(PROMPTS[1], params):
                reason = output.finish_reason
                if output.token_ids and len(output.token_ids) == 2:
                    asyncio.get_running_loop().create_task(engine.stop())

        await asyncio.wait_for(consume(), timeout=30)
        return reason

    assert asyncio.run(main()) == "abort"


def test_abort_all_ends_a_request_still_compiling_its_grammar(tiny_llama: Path) -> None:
    engine_ = make_engine(tiny_llama)
    compile_grammar = engine_.grammars.compile
    started, release = threading.Event(), threading.Event()

    def held(constraint: GrammarConstraint):
        started.set()
        assert release.wait(30)
        return compile_grammar(constraint)

    engine_.grammars.compile = held  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=20, n=2, constraint=GrammarConstraint.regex("[a-z]+"))

    async def main() -> list[tuple[int, str | None, int]]:
        engine = AsyncEngine(engine_)
        engine.start()
        try:

            async def consume() -> list[tuple[int, str | None, int]]:
                return [(o.index, o.finish_reason, len(o.token_ids)) async for o in engine.generate(PROMPTS[0], params)]

            stream = asyncio.create_task(consume())
            assert await asyncio.to_thread(started.wait, 30)
            engine.abort_all()
            release.set()
            outputs = await asyncio.wait_for(stream, timeout=30)
            stats = await engine.call(lambda e: e.stats())
            assert stats.num_running == stats.num_waiting == 0 and stats.num_generated_tokens == 0
            return outputs
        finally:
            release.set()
            await engine.stop()

    assert asyncio.run(main()) == [(0, "abort", 0), (1, "abort", 0)]


@pytest.mark.default_model
def test_given_a_config_the_step_thread_builds_the_engine_it_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """libgomp's pool is per thread: stepping on another thread than the builder's is slower (engine_build.py)."""
    threads = record_engine_threads(monkeypatch)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def main() -> AsyncEngine:
        engine = AsyncEngine(default_model_config())
        await asyncio.wait_for(asyncio.wrap_future(engine.start()), 120)
        try:
            outputs = [output async for output in engine.generate(PROMPTS[0], params)]
        finally:
            await engine.stop()
        assert len(outputs[-1].token_ids) == 8 and outputs[-1].request_finished
        return engine

    threads.check_stepped_where_built(asyncio.run(main()).engine)


def test_a_config_it_cannot_build_from_fails_start_with_the_engines_error(tmp_path: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(EngineConfig(model=str(tmp_path)))
        with pytest.raises(ConfigError, match=r"config\.json"):
            await asyncio.wait_for(asyncio.wrap_future(engine.start()), 30)
        with pytest.raises(EngineDeadError, match=r"config\.json"):
            async for _ in engine.generate("hello", SamplingParams()):
                pass
        await asyncio.wait_for(engine.stop(), 30)

    asyncio.run(main())
