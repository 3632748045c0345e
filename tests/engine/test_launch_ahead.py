"""Launching the next decode pass ahead (engine/step/launch_ahead.py) changes when the device works, never a token.

Each workload runs twice on the CPU, with the pass launched ahead and without; the outputs must be the same,
token for token and text for text, and the pool's bookkeeping must hold after every step (the pass takes the
slots of the token it computes before the step is applied). The workloads make the next step differ from the
pass in every way it can: sequences that end by a stop token (their row is left out), a request admitted when
one ends (the pass is dropped), preemption under a small pool, an abort between steps.
"""

import random
from pathlib import Path

import pytest

import engine.step.launch_ahead as launch_ahead
import engine.step.step_runner as step_runner
from engine import Engine, SamplingParams
from engine.memory.page_pool import OwnerKind
from tests.engine.conftest import check_invariants, make_engine
from tests.engine.lora_helpers import make_peft_adapter

NUM_REQUESTS = 24


@pytest.fixture(scope="module")
def adapter(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(
        tiny_llama, tmp_path_factory.mktemp("ahead") / "qv", seed=5, r=4, target_modules=["q_proj", "v_proj"]
    )


def workload(stop_token: int | None) -> tuple[list[list[int]], list[SamplingParams], list[str | None]]:
    """Greedy and seeded requests of different lengths, every third with the adapter, every fourth with logprobs."""
    rng = random.Random(1)
    prompts, params, adapters = [], [], []
    for i in range(NUM_REQUESTS):
        prompts.append([rng.randrange(3, 300) for _ in range(rng.randrange(4, 30))])
        seeded = i % 2 == 1
        params.append(
            SamplingParams(
                max_tokens=rng.randrange(6, 24),
                ignore_eos=True,
                temperature=0.9 if seeded else 0.0,
                seed=7 + i if seeded else None,
                stop_token_ids=[stop_token] if stop_token is not None and i % 3 == 0 else [],
                logprobs=2 if i % 4 == 2 else None,
            )
        )
        adapters.append("qv" if i % 3 == 1 else None)
    return prompts, params, adapters


def run(engine: Engine, prompts, params, adapters, abort_at: int | None = None) -> dict[str, tuple]:
    """Every request to its end, the invariants checked after each step; (tokens, text, finish, logprobs) by
    request."""
    ids = [engine.add_request(p, sp, adapter=a) for p, sp, a in zip(prompts, params, adapters, strict=True)]
    finals = {}
    step = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        step += 1
        if step == abort_at:
            outputs += engine.abort_request(ids[0])
        for output in outputs:
            if output.finished:
                finals[output.request_id] = (
                    list(output.token_ids),
                    output.text,
                    output.finish_reason,
                    output.logprobs and list(output.logprobs),
                )
        check_invariants(engine)
    assert engine.pool.stats().pages_by_owner[OwnerKind.KV.value] == 0, "pages leaked after all requests ended"
    return {request_id: finals[request_id] for request_id in ids}


def both(
    tiny_llama: Path, adapter: Path, kernels: str, abort_at: int | None = None, stop_token=None, propose=None, **config
):
    """The workload without launching ahead, then with (``propose``: the speculator's proposer); the second engine,
    to read its counts."""
    results = []
    for ahead in (False, True):
        engine = make_engine(tiny_llama, kernels=kernels, launch_ahead=ahead, **config)
        engine.add_adapter("qv", adapter)
        if propose is not None:
            engine.speculator.propose = propose
        results.append(run(engine, *workload(stop_token), abort_at=abort_at))
    assert_same(results[1], results[0], kernels)
    return engine


def assert_same(got: dict[str, tuple], expected: dict[str, tuple], kernels: str) -> None:
    """The same tokens, text and finish; the same logprobs, to the bit on the native kernels (a row is the same
    bits in any batch there) and within 1e-5 on the torch ones, which promise no such thing."""
    if kernels == "native":
        assert got == expected
        return
    assert got.keys() == expected.keys()
    for request_id, (tokens, text, finish, logprobs) in expected.items():
        got_tokens, got_text, got_finish, got_logprobs = got[request_id]
        assert (got_tokens, got_text, got_finish) == (tokens, text, finish), request_id
        assert (got_logprobs is None) == (logprobs is None), request_id
        for entry, got_entry in zip(logprobs or (), got_logprobs or (), strict=True):
            assert got_entry.token_id == entry.token_id
            assert got_entry.logprob == pytest.approx(entry.logprob, abs=1e-5)
            assert [token for token, _ in got_entry.top] == [token for token, _ in entry.top]


def a_frequent_token(tiny_llama: Path, adapter: Path, kernels: str) -> int:
    """A token the workload's greedy outputs draw often, so a stop on it ends some of them early."""
    engine = make_engine(tiny_llama, kernels=kernels)
    engine.add_adapter("qv", adapter)
    outputs = run(engine, *workload(None))
    counts: dict[int, int] = {}
    for tokens, *_ in outputs.values():
        for token in tokens:
            counts[token] = counts.get(token, 0) + 1
    return max(counts, key=counts.__getitem__)


def test_same_tokens_when_every_request_runs_at_once(tiny_llama: Path, adapter: Path, kernels: str) -> None:
    engine = both(tiny_llama, adapter, kernels, max_num_seqs=32)
    stats = engine.stats()
    assert stats.num_steps_launched_ahead >= 15, stats  # the longest request decodes 23 tokens, most from passes


def test_same_tokens_when_stops_end_rows_and_waiting_requests_take_their_slots(
    tiny_llama: Path, adapter: Path, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request admitted when another ends runs its prompt beside the rows the pass ran for the others."""
    take = launch_ahead.LaunchAhead.take
    mixed = []

    def recording_take(self, items):
        taken = take(self, items)
        if taken is not None and taken.rest:
            mixed.append((len(taken.seqs), len(taken.rest)))
        return taken

    monkeypatch.setattr(launch_ahead.LaunchAhead, "take", recording_take)
    stop = a_frequent_token(tiny_llama, adapter, kernels)
    engine = both(tiny_llama, adapter, kernels, stop_token=stop, max_num_seqs=8)
    assert engine.stats().num_steps_launched_ahead > 0
    assert len(mixed) >= 3, mixed  # steps of pass rows and rows of their own (admissions)


def test_same_tokens_under_preemption_and_an_abort(tiny_llama: Path, adapter: Path, kernels: str) -> None:
    engine = both(tiny_llama, adapter, kernels, abort_at=5, max_num_seqs=16, pool_bytes=24 * 8192)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_steps_launched_ahead > 0, stats


def test_same_tokens_when_proposals_run_beside_the_rows_of_a_pass(
    tiny_llama: Path, adapter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With speculative decoding on and room for proposals, a pass is launched after each step that verified none;
    a row that gets proposals in the next step verifies them in the step's own forward pass beside the pass's rows,
    and no pass is launched after a step that verified proposals (rows would be at positions the host reads)."""
    take = launch_ahead.LaunchAhead.take
    launch = launch_ahead.LaunchAhead.launch
    beside, after_proposals = [], []

    def recording_take(self, items):
        taken = take(self, items)
        if taken is not None and any(item.draft_token_ids for item in taken.rest):
            beside.append((len(taken.seqs), len(taken.rest)))
        return taken

    def recording_launch(self, rows, token_ids):
        launch(self, rows, token_ids)
        if any(isinstance(row, launch_ahead.DraftPosition) for row in rows):
            after_proposals.append(self._pending)

    monkeypatch.setattr(launch_ahead.LaunchAhead, "take", recording_take)
    monkeypatch.setattr(launch_ahead.LaunchAhead, "launch", recording_launch)

    def every_third_position_repeats_its_last_token(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
        return [token_ids[-1]] * k if len(token_ids) % 3 == 0 else []

    engine = both(
        tiny_llama,
        adapter,
        "native",
        propose=every_third_position_repeats_its_last_token,
        max_num_seqs=32,
        num_speculative_tokens=3,
        speculative_max_step_tokens=64,
    )
    stats = engine.stats()
    assert stats.num_steps_launched_ahead > 0 and sum(stats.num_proposed_tokens.values()) > 0, stats
    assert beside, "some step ran proposals beside a pass's rows"
    assert after_proposals and not any(after_proposals), "no pass after a step that verified proposals"


def test_launch_ahead_defaults_to_cuda_only(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=32)
    run(engine, *workload(None)[:2], [None] * NUM_REQUESTS)
    assert engine.stats().num_steps_launched_ahead == 0


def test_same_tokens_when_a_step_fails_after_its_pass_was_launched(
    tiny_llama: Path, adapter: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batched step fails once its tokens are drawn and the next pass queued; it runs again row by row, and
    seeded rows draw again: the pass, which took the first draw's tokens, must not serve the step after."""
    accept = step_runner.accept
    calls = {"batched": 0}

    def failing_once_batched(rows, token_ids, logprobs):
        if len(rows) > 1:
            calls["batched"] += 1
            if calls["batched"] == 4:
                raise RuntimeError("a fault after the draw")
        return accept(rows, token_ids, logprobs)

    monkeypatch.setattr(step_runner, "accept", failing_once_batched)
    results = []
    for ahead in (False, True):
        calls["batched"] = 0
        engine = make_engine(tiny_llama, kernels="native", launch_ahead=ahead, max_num_seqs=32)
        engine.add_adapter("qv", adapter)
        results.append(run(engine, *workload(None)))
        assert calls["batched"] > 4
    assert results[1] == results[0]
    assert engine.stats().num_steps_launched_ahead > 0


def test_a_pass_that_fails_to_launch_leaves_every_later_step_its_own_pass(
    tiny_llama: Path, adapter: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    expected = run(make_engine(tiny_llama, kernels="native", max_num_seqs=32), *workload(None)[:2], [None] * 24)
    engine = make_engine(tiny_llama, kernels="native", launch_ahead=True, max_num_seqs=32)
    build = launch_ahead.build_step_batch
    launches = []

    def failing_third(*args, **kwargs):
        launches.append(1)
        if len(launches) == 3:
            raise RuntimeError("a fault while building a pass")
        return build(*args, **kwargs)

    monkeypatch.setattr(launch_ahead, "build_step_batch", failing_third)
    assert run(engine, *workload(None)[:2], [None] * 24) == expected
    assert len(launches) == 3 and engine.stats().num_steps_launched_ahead == 2
    assert "launching a decode pass ahead failed" in caplog.text
