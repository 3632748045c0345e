"""n choices from one prompt: the prompt is computed once, its blocks shared, and each choice then runs on its own."""

from pathlib import Path

import pytest

from engine import Engine, RequestError, RequestOutput, SamplingParams
from tests.engine.conftest import check_invariants, make_engine
from tests.engine.lora_helpers import make_peft_adapter

PROMPT = [(11 * j) % 250 + 3 for j in range(200)]  # 12 full blocks of 16 and a partial one of 8
MAX_TOKENS = 12
TINY_PAGE_BYTES = 16 * 2 * 2 * 16 * 4 * 2  # block 16 x K and V x 2 kv heads x head_dim 16 x fp32 x 2 layers


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict[tuple[str, int], RequestOutput]:
    """Every request to its end, invariants checked after each step; final outputs by (request id, choice)."""
    for prompt, params in requests:
        engine.add_request(prompt, params)
    finals: dict[tuple[str, int], RequestOutput] = {}
    finished_requests: set[str] = set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id not in finished_requests, "an output came after its request finished"
            if output.finished:
                finals[output.request_id, output.index] = output
            if output.request_finished:
                finished_requests.add(output.request_id)
        check_invariants(engine)
    assert engine.pool.stats().pages_by_owner["kv"] == 0
    return finals


def test_n_choices_prefill_the_prompt_once_and_share_its_blocks(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, enable_prefix_caching=False)
    assert engine.pool.block_size == 16
    params = SamplingParams(n=4, max_tokens=4, temperature=1.0, seed=5, ignore_eos=True)
    finals = _run(engine, [(PROMPT, params)])
    assert sorted(index for _, index in finals) == [0, 1, 2, 3]
    stats = engine.stats()
    assert stats.num_prefill_tokens == len(PROMPT)  # not 4 x 200
    assert stats.num_prompt_tokens == len(PROMPT)
    # 13 blocks for the prompt, once; 3 copies of its partial last block (the last writer keeps the original);
    # 8 + 4 tokens still fit that block, so no choice needs another.
    assert stats.num_kv_blocks_allocated == 13 + 3
    separate = make_engine(tiny_llama, enable_prefix_caching=False)
    _run(separate, [(PROMPT, SamplingParams(max_tokens=4, temperature=1.0, seed=5 + i)) for i in range(4)])
    assert separate.stats().num_prefill_tokens == 4 * len(PROMPT)
    assert separate.stats().num_kv_blocks_allocated == 4 * 13


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="roomy"),
        pytest.param({"max_num_batched_tokens": 32, "max_num_seqs": 6}, id="chunked"),
        pytest.param({"pool_bytes": 24 * TINY_PAGE_BYTES, "max_num_seqs": 8}, id="preemption"),
    ],
)
def test_each_choice_equals_a_request_of_its_own_seed(tiny_llama: Path, overrides: dict) -> None:
    """Choice i with seed s draws what a lone request with seed s + i draws: shared KV never leaks between them."""
    engine = make_engine(tiny_llama, **overrides)
    forked = SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=1.0, seed=40, ignore_eos=True, logprobs=2)
    greedy = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    short = PROMPT[:37]
    finals = _run(engine, [(PROMPT, forked), (short, greedy), (PROMPT[5:90], forked)])
    if "pool_bytes" in overrides:
        assert engine.stats().num_preemptions > 0
    alone = make_engine(tiny_llama)
    for request_id, prompt in (("req-0", PROMPT), ("req-2", PROMPT[5:90])):
        for index in range(3):
            lone = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=40 + index, ignore_eos=True, logprobs=2)
            [expected] = alone.generate([prompt], lone)
            choice = finals[request_id, index]
            assert choice.token_ids == expected.token_ids, (request_id, index)
            assert choice.text == expected.text
            assert [e.token_id for e in choice.logprobs] == choice.token_ids
            expected_logprobs = [e.logprob for e in expected.logprobs]
            assert [e.logprob for e in choice.logprobs] == pytest.approx(expected_logprobs, abs=1e-4)
    assert finals["req-1", 0].token_ids == finals["req-1", 1].token_ids


def test_abort_ends_every_choice_and_frees_the_shared_blocks(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    request_id = engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    while engine.stats().num_running < 3:
        engine.step()
        check_invariants(engine)
    outputs = engine.abort_request(request_id)
    assert sorted(o.index for o in outputs) == [0, 1, 2]
    assert all(o.finish_reason == "abort" and o.request_finished for o in outputs)
    check_invariants(engine)
    assert engine.pool.stats().pages_by_owner["kv"] == 0 and not engine.has_unfinished_requests()


def test_n_larger_than_the_batch_is_refused(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=4)
    with pytest.raises(RequestError, match="max_num_seqs"):
        engine.add_request(PROMPT, SamplingParams(n=5))


def test_choices_of_an_adapter_request_hold_the_adapter_until_each_ends(tiny_llama: Path, tmp_path: Path) -> None:
    engine = make_engine(tiny_llama)
    engine.add_adapter("qv", make_peft_adapter(tiny_llama, tmp_path / "qv", seed=3, r=4, target_modules=["q_proj"]))
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=8, ignore_eos=True)
    finals = _run_with_adapter(engine, params)
    entry = engine.adapters.get("qv")
    assert entry.num_running == 0 and entry.num_requests == 0
    engine.remove_adapter("qv")  # no choice holds it any more
    alone = make_engine(tiny_llama)
    alone.add_adapter("qv", tmp_path / "qv")
    for index in range(3):
        lone = SamplingParams(max_tokens=6, temperature=1.0, seed=8 + index, ignore_eos=True)
        [expected] = alone.generate([PROMPT[:50]], lone, adapters=["qv"])
        assert finals["req-0", index].token_ids == expected.token_ids


def _run_with_adapter(engine: Engine, params: SamplingParams) -> dict[tuple[str, int], RequestOutput]:
    engine.add_request(PROMPT[:50], params, adapter="qv")
    finals: dict[tuple[str, int], RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id, output.index] = output
        check_invariants(engine)
        if engine.stats().num_running == 3:
            assert engine.adapters.get("qv").num_running == 3
    return finals


def test_every_choice_reports_the_prompts_cache_hits(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    _run(engine, [(PROMPT, SamplingParams(max_tokens=1, temperature=0.0))])  # the prompt's full blocks are cached
    finals = _run(engine, [(PROMPT, SamplingParams(n=3, max_tokens=3, temperature=0.0))])
    assert [finals["req-1", i].num_cached_tokens for i in range(3)] == [192, 192, 192]  # 12 full blocks of 16
