"""Scheduling as a caller sees it: long prompts never stall decoding, limits hold, aborts free pages."""

from pathlib import Path

from engine import SamplingParams
from engine.memory.page_pool import OwnerKind
from tests.engine.conftest import check_invariants, make_engine


def test_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, max_num_batched_tokens=32, max_num_seqs=4)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    short = engine.add_request([7] * 5, params)
    for _ in range(2):
        engine.step()
    long = engine.add_request(list(range(3, 203)), SamplingParams(max_tokens=2, temperature=0.0))
    steps_until_long_starts = 0
    while True:
        outputs = {o.request_id: o for o in engine.step()}
        check_invariants(engine)
        assert short in outputs, "the decoding request must get a token in every step of the long prefill"
        if long in outputs:
            break
        steps_until_long_starts += 1
    # 200 prompt tokens through a 32-token budget shared with one decode row: 7 chunks of at most 31.
    assert steps_until_long_starts == 6


def test_max_num_seqs_bounds_the_running_set(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=3)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(7):
        engine.add_request([5 + i] * 8, params)
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) <= 3
        check_invariants(engine)


def test_abort_frees_pages_of_running_and_waiting_requests(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=1)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    running = engine.add_request([9] * 40, params)
    waiting = engine.add_request([8] * 40, params)
    engine.step()
    assert engine.stats().num_running == 1 and engine.stats().num_waiting == 1
    [aborted_running] = engine.abort_request(running)
    [aborted_waiting] = engine.abort_request(waiting)
    assert aborted_running.finish_reason == aborted_waiting.finish_reason == "abort"
    assert engine.abort_request(running) == []
    check_invariants(engine)
    assert engine.pool.stats().pages_by_owner[OwnerKind.KV.value] == 0
    assert not engine.has_unfinished_requests()
