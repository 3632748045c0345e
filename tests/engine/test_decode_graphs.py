"""Decode steps through CUDA graphs (engine/step/decode_graphs.py) give the tokens and logprobs of eager steps.

On a CPU the padded steps run eagerly over the graphs' buffers under Triton's interpreter (``capture=False``):
the padding rows and their scratch page, buffers refilled as the batch shrinks and grows, the attention's split
axis sized for the longest context (tests/kernels/test_paged_attention_split.py checks it on rows of several
chunks), prefill steps between them run eagerly: everything but the capture. On a
CUDA machine with the interpreter off (scripts/tools/gpu_checks.py), the same tests capture and replay graphs.
"""

import logging
import os
import random
from pathlib import Path

import pytest
import torch

from engine import Engine, SamplingParams
from engine.memory.page_pool import OwnerKind
from engine.step.decode_graphs import GRAPH_BUCKETS, DecodeGraphs, bucket_rows
from tests.engine.conftest import check_invariants, make_engine
from tests.engine.lora_helpers import make_peft_adapter

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0"
MAX_NUM_SEQS = 8
MAX_TOKENS = (12, 3, 6, 2, 5, 8, 4)  # requests end at different steps: the batch shrinks through every bucket
LATE = 2  # the last requests arrive while the first decode: their prefill steps run eagerly between graph steps


def _engine(folder: Path, graphs: bool, launch_ahead: bool | None = None) -> tuple[Engine, DecodeGraphs | None]:
    engine = make_engine(
        folder,
        kernels="triton",
        device="cuda" if ON_CUDA else "cpu",
        max_num_seqs=MAX_NUM_SEQS,
        num_speculative_tokens=0,
        launch_ahead=launch_ahead,
    )
    runner = engine._runner
    if not graphs:
        runner.decode_graphs = None
    elif runner.decode_graphs is None:  # a CPU: the padded steps, run eagerly
        runner.decode_graphs = DecodeGraphs(engine.model, engine.pool, MAX_NUM_SEQS, engine.max_model_len, False)
    return engine, runner.decode_graphs


def _generate(
    engine: Engine,
    prompts: list[list[int]],
    adapters: tuple[str | None, ...] = (),
    max_tokens: tuple[int, ...] = MAX_TOKENS,
    late: int = LATE,
) -> dict[str, tuple]:
    """Each request's tokens and logprobs; the last ``late`` requests join after the first decode step. Request
    ``i`` asks ``max_tokens[i]`` tokens of adapter ``adapters[i]`` (None or past the tuple: the base model)."""
    finals: dict[str, tuple] = {}

    def add(index: int) -> None:
        params = SamplingParams(max_tokens=max_tokens[index], temperature=0.0, ignore_eos=True, logprobs=2)
        adapter = adapters[index] if index < len(adapters) else None
        engine.add_request(prompts[index], params, request_id=str(index), adapter=adapter)

    for index in range(len(prompts) - late):
        add(index)
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = (
                    tuple(output.token_ids),
                    tuple((lp.token_id, lp.logprob, tuple(lp.top)) for lp in output.logprobs),
                )
        check_invariants(engine)
        steps += 1
        if steps == 2:
            for index in range(len(prompts) - late, len(prompts)):
                add(index)
    return finals


def _prompts(engine: Engine, count: int = len(MAX_TOKENS)) -> list[list[int]]:
    rng = random.Random(5)
    vocab = engine.model_config.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 20))] for _ in range(count)]


def _assert_same(got: dict[str, tuple], expected: dict[str, tuple]) -> None:
    assert got.keys() == expected.keys()
    for request_id, (tokens, logprobs) in expected.items():
        got_tokens, got_logprobs = got[request_id]
        assert got_tokens == tokens, f"request {request_id}"
        for (token_id, logprob, top), (got_id, got_logprob, got_top) in zip(logprobs, got_logprobs, strict=True):
            assert got_id == token_id
            assert got_logprob == pytest.approx(logprob, abs=1e-5)
            assert [token for token, _ in got_top] == [token for token, _ in top]


def test_graph_steps_give_the_tokens_and_logprobs_of_eager_steps(tiny_llama: Path) -> None:
    eager, _ = _engine(tiny_llama, graphs=False)
    graphed, graphs = _engine(tiny_llama, graphs=True)
    prompts = _prompts(eager)

    expected = _generate(eager, prompts)
    _assert_same(_generate(graphed, prompts), expected)
    assert len(expected) == len(MAX_TOKENS)
    assert graphs.buckets == (1, 2, 4, 8), "the batch grows and shrinks through every bucket up to max_num_seqs"
    assert graphs.num_graphs == (len(graphs.buckets) if ON_CUDA else 0)
    scratch = [page for page in graphed.pool.pages if page.owner is OwnerKind.SCRATCH]
    assert len(scratch) == 1 and scratch[0].ref_count == 1
    assert graphed.pool.stats().pages_by_owner[OwnerKind.KV.value] == 0, "every request's pages went back"


@pytest.fixture(scope="module")
def graph_adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Four adapters of other ranks and modules: all linear at ranks 4 and 6, q/v at 8, o/down at 20 (past one
    tile of 16 ranks, so its steps take the next rank capacity)."""
    root = tmp_path_factory.mktemp("graph-adapters")
    return {
        "all": make_peft_adapter(tiny_llama, root / "all", seed=11, r=4, target_modules="all-linear"),
        "two": make_peft_adapter(tiny_llama, root / "two", seed=14, r=6, target_modules="all-linear"),
        "qv": make_peft_adapter(tiny_llama, root / "qv", seed=12, r=8, target_modules=["q_proj", "v_proj"]),
        "wide": make_peft_adapter(tiny_llama, root / "wide", seed=13, r=20, target_modules=["o_proj", "down_proj"]),
    }


def test_graph_steps_with_adapters_give_the_tokens_and_logprobs_of_eager_steps(
    tiny_llama: Path, graph_adapters: dict[str, Path]
) -> None:
    """Adapters and base rows mixed, the runs changing as requests join and end (between steps of one bucket and
    capacity too, whose runs then start at other rows and number fewer tiles): every step's SGMV tables go into
    its graph's padded ones, and each token and logprob is the eager engine's."""
    engines = [_engine(tiny_llama, graphs=False)[0], *_engine(tiny_llama, graphs=True)]
    eager, graphed, graphs = engines
    for engine in eager, graphed:
        for name, folder in graph_adapters.items():
            engine.add_adapter(name, folder)
    adapters = ("all", "qv", None, "two", "wide", "all", "qv", "two")
    max_tokens = (12, 5, 10, 7, 3, 11, 9, 6)  # all join at once, then leave one by one
    prompts = _prompts(eager, len(adapters))

    expected = _generate(eager, prompts, adapters, max_tokens, late=0)
    got = _generate(graphed, prompts, adapters, max_tokens, late=0)

    _assert_same(got, expected)
    assert len(expected) == len(adapters)
    assert expected != _generate(eager, prompts, (), max_tokens, late=0), "the adapters change the answers"
    capacities = [capacity for _, capacity in graphs.keys if capacity is not None]
    assert {capacity.rank for capacity in capacities} == {16, 32}, "rank 20 rounds up to 32"
    assert ("qkv", "o", "gate_up", "down") in [capacity.groups for capacity in capacities]
    assert graphs.num_graphs == (len(graphs.keys) if ON_CUDA else 0)


def test_graph_steps_launched_ahead_give_the_tokens_and_logprobs_of_eager_steps(
    tiny_llama: Path, graph_adapters: dict[str, Path]
) -> None:
    """Each decode pass queued before the step before's tokens are read (engine/step/launch_ahead.py): its input
    ids are the drawn tokens, gathered on the device into the graph's buffer after the upload, and the logprobs
    are read without waiting for it. Requests end one by one and two join late (their prompts run beside the
    pass's rows, eagerly); the tokens and logprobs are the eager engine's without passes."""
    eager = _engine(tiny_llama, graphs=False, launch_ahead=False)[0]
    ahead, graphs = _engine(tiny_llama, graphs=True, launch_ahead=True)
    for engine in eager, ahead:
        for name, folder in graph_adapters.items():
            engine.add_adapter(name, folder)
    adapters = ("all", "qv", None, "two", "wide", "all", "qv")
    prompts = _prompts(eager, len(adapters))

    expected = _generate(eager, prompts, adapters)
    _assert_same(_generate(ahead, prompts, adapters), expected)
    stats = ahead.stats()
    assert stats.num_steps_launched_ahead >= 5, stats
    assert graphs.buckets, "the passes ran through the graphs' buffers"


def test_a_step_the_graphs_cannot_take_runs_eagerly(tiny_llama: Path) -> None:
    """Prefill chunks, and decode steps past max_num_seqs rows, never reach a graph."""
    engine, graphs = _engine(tiny_llama, graphs=True)
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=1, temperature=0.0), request_id="p")
    engine.step()  # the prompt's prefill, which also samples the one token asked
    assert not engine.has_unfinished_requests()
    assert graphs.buckets == ()


@pytest.mark.skipif(ON_CUDA, reason="a capture that fails: on a CPU, any")
def test_a_failed_capture_leaves_every_step_eager(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Asked to capture where there is no CUDA, the first graph step fails to record: that step and every
    later one run without graphs, with the same tokens, and the log says why."""
    eager, _ = _engine(tiny_llama, graphs=False)
    failing, _ = _engine(tiny_llama, graphs=False)
    graphs = failing._runner.decode_graphs = DecodeGraphs(
        failing.model, failing.pool, MAX_NUM_SEQS, failing.max_model_len, capture=True
    )
    prompts = _prompts(eager)

    with caplog.at_level(logging.ERROR, logger="engine.step.decode_graphs"):
        got = _generate(failing, prompts)

    assert got == _generate(eager, prompts)
    assert graphs.buckets == () and graphs.num_graphs == 0
    assert sum("decode steps run without graphs" in record.message for record in caplog.records) == 1


@pytest.mark.parametrize(
    ("num_rows", "max_rows", "rows"),
    [(1, 64, 1), (3, 64, 4), (5, 64, 8), (17, 64, 32), (33, 64, 48), (64, 64, 64), (97, 100, 100), (8, 6, 6)],
)
def test_a_step_pads_to_the_next_bucket_within_max_num_seqs(num_rows: int, max_rows: int, rows: int) -> None:
    assert bucket_rows(num_rows, max_rows) == rows
    assert list(GRAPH_BUCKETS) == sorted(set(GRAPH_BUCKETS))
