"""Logprobs and prompt logprobs equal transformers + PEFT's log-softmax, in mixed batches of adapters and base rows.

On the tiny random Llama and on the default model; in one batch, with chunked prefill, with the prompt
already in the prefix cache, and with preemption (a small pool), so every path that computes a prompt
position is checked.
"""

from pathlib import Path

import pytest
import torch
from peft import PeftModel

from engine import Engine, RequestOutput, SamplingParams
from tests.engine.conftest import check_invariants, make_engine
from tests.engine.lora_helpers import load_peft_model, make_peft_adapter

ADAPTERS = {"qv": dict(r=8, target_modules=["q_proj", "v_proj"]), "all": dict(r=4, target_modules="all-linear")}
PROMPTS = [list(range(10, 47)), [5, 9, 11, 40, 7, 3, 3, 3, 90, 91, 92], [100, 101, 102, 5] * 6]
ROW_ADAPTERS = ["qv", None, "all"]
MAX_TOKENS = 6
NUM_TOP = 4
ABS_TOL = 1e-3  # the bound on a logprob's difference
POOL_BYTES = 256 * 1024**2


@pytest.fixture(scope="module")
def adapter_folders(base_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("logprob-adapters")
    return {
        name: make_peft_adapter(base_folder, root / name, seed=i + 11, **kwargs)
        for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def peft_model(base_folder: Path, adapter_folders: dict[str, Path]) -> PeftModel:
    return load_peft_model(base_folder, adapter_folders)


def _peft_logprobs(model: PeftModel, token_ids: list[int], adapter: str | None) -> torch.Tensor:
    """Log-softmax of PEFT's logits at every position of one unpadded row: [len(token_ids), vocab]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids]), adapter_names=[adapter or "__base__"]).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _run(engine: Engine, params: SamplingParams) -> list[RequestOutput]:
    ids = [engine.add_request(p, params, adapter=a) for p, a in zip(PROMPTS, ROW_ADAPTERS, strict=True)]
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        check_invariants(engine)
    return [finals[i] for i in ids]


def _make(base_folder: Path, adapter_folders: dict[str, Path], **overrides) -> Engine:
    overrides.setdefault("pool_bytes", POOL_BYTES)
    engine = make_engine(base_folder, **overrides)
    for name, folder in adapter_folders.items():
        engine.add_adapter(name, folder)
    return engine


def _assert_close(entry, reference: torch.Tensor, token_id: int) -> None:
    """One engine entry against the reference row [vocab]: the token's logprob and the top alternatives."""
    assert entry.token_id == token_id
    assert abs(entry.logprob - reference[token_id].item()) <= ABS_TOL
    ref_values = reference.topk(NUM_TOP).values
    assert len(entry.top) == NUM_TOP
    for (top_id, top_value), ref_value in zip(entry.top, ref_values.tolist(), strict=True):
        assert abs(top_value - ref_value) <= ABS_TOL
        assert abs(reference[top_id].item() - top_value) <= ABS_TOL  # the id is one of that value (ties allowed)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="one_batch"),
        pytest.param({"max_num_batched_tokens": 8, "max_num_seqs": 4}, id="chunked_prefill"),
        pytest.param({"prefix_hit": True}, id="prefix_cache_hit"),
    ],
)
def test_logprobs_and_prompt_logprobs_match_peft(base_folder, adapter_folders, peft_model, overrides, kernels) -> None:
    overrides = dict(overrides)  # the parametrized dict is shared by both kernel backends' runs
    prefix_hit = overrides.pop("prefix_hit", False)
    engine = _make(base_folder, adapter_folders, kernels=kernels, **overrides)
    if prefix_hit:  # the same prompts once without logprobs: their full blocks are now in the prefix cache
        _run(engine, SamplingParams(max_tokens=1, temperature=0.0))
        assert engine.stats().pages_by_owner["prefix_cache"] >= sum(len(p) // engine.pool.block_size for p in PROMPTS)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=NUM_TOP, prompt_logprobs=NUM_TOP
    )
    outputs = _run(engine, params)
    for prompt, adapter, output in zip(PROMPTS, ROW_ADAPTERS, outputs, strict=True):
        full = prompt + output.token_ids
        reference = _peft_logprobs(peft_model, full, adapter)  # [len(full), vocab]
        assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt)
        assert output.prompt_logprobs[0] is None
        for position in range(1, len(prompt)):
            _assert_close(output.prompt_logprobs[position], reference[position - 1], prompt[position])
        assert output.logprobs is not None and len(output.logprobs) == MAX_TOKENS
        for step, entry in enumerate(output.logprobs):
            _assert_close(entry, reference[len(prompt) + step - 1], output.token_ids[step])


def test_prompt_logprobs_survive_preemption(base_folder, adapter_folders) -> None:
    """A pool that holds one sequence and a part of another: the second is preempted midway through its prompt."""
    prompt_len, max_tokens = 96, 8
    long_prompts = [[(7 * i + j) % 200 + 3 for j in range(prompt_len)] for i in range(len(ROW_ADAPTERS))]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=2)

    def run(engine: Engine) -> list[RequestOutput]:
        ids = [engine.add_request(p, params, adapter=a) for p, a in zip(long_prompts, ROW_ADAPTERS, strict=True)]
        finals = {}
        while engine.has_unfinished_requests():
            finals |= {o.request_id: o for o in engine.step() if o.finished}
            check_invariants(engine)
        return [finals[i] for i in ids]

    roomy_engine = _make(base_folder, adapter_folders)
    roomy = run(roomy_engine)
    kv = roomy_engine.kv
    largest_adapter = max(roomy_engine.adapters.get(name).layout.num_pages for name in adapter_folders)
    num_pages = largest_adapter + kv.num_blocks_for(prompt_len + max_tokens) + kv.num_blocks_for(prompt_len) // 2
    page_bytes = roomy_engine.pool.storage[0].numel() * roomy_engine.pool.storage.element_size()
    tight = _make(
        base_folder, adapter_folders, pool_bytes=num_pages * page_bytes, max_num_batched_tokens=32, max_num_seqs=3
    )
    squeezed = run(tight)
    assert tight.stats().num_preemptions > 0
    for alone, crowded in zip(roomy, squeezed, strict=True):
        assert crowded.token_ids == alone.token_ids
        assert len(crowded.prompt_logprobs) == len(alone.prompt_logprobs) == prompt_len
        assert crowded.prompt_logprobs[0] is None
        for mine, theirs in zip(crowded.prompt_logprobs[1:], alone.prompt_logprobs[1:], strict=True):
            assert mine.token_id == theirs.token_id and abs(mine.logprob - theirs.logprob) <= ABS_TOL


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(base_folder, adapter_folders) -> None:
    engine = _make(base_folder, adapter_folders)
    [output] = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=0, prompt_logprobs=1), adapters=["qv"])
    assert output.token_ids == [] and output.finish_reason == "length" and output.text == ""
    assert len(output.prompt_logprobs) == len(PROMPTS[0]) and all(len(e.top) == 1 for e in output.prompt_logprobs[1:])
    assert engine.stats().num_generated_tokens == 0
