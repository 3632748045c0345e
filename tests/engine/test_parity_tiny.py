"""The engine's greedy tokens equal transformers' on tiny random Llama, Qwen2 and Mistral models."""

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import SamplingParams
from tests.engine.conftest import make_engine, run_checked

MAX_TOKENS = 12
PAGE_BYTES = 2 * 16 * 2 * 2 * 16 * 4  # layers x block_size x (K, V) x kv_heads x head_dim x fp32


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(40)]
    lengths = [1, 5, 16, 17, 31, 64, 100, 3]
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]
    prompts += [shared + [rng.randrange(3, vocab_size) for _ in range(n)] for n in (2, 9, 23)]  # shared prefix
    return prompts


def _reference(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    refs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        refs.append(out[0, len(prompt) :].tolist())
    return refs


CASES = {
    "plain": {},
    "chunked_prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "preemption": {"pool_bytes": 10 * PAGE_BYTES, "max_num_seqs": 8},
    "no_prefix_cache": {"enable_prefix_caching": False},
}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(model_type: str, case: str, kernels: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(f"tiny_{model_type}")
    engine = make_engine(folder, kernels=kernels, **CASES[case])
    prompts = _prompts(engine.model_config.vocab_size)
    refs = _reference(folder, prompts)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    finals = run_checked(engine)
    for request_id, prompt, ref in zip(ids, prompts, refs, strict=True):
        assert finals[request_id].token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
    stats = engine.stats()
    if case == "preemption":
        assert stats.num_preemptions > 0, "the small pool was meant to force preemption"
    if case == "chunked_prefill":  # later prompts are admitted after the shared prefix is computed
        assert stats.num_cached_prompt_tokens >= 32, "prompts with a 40-token shared prefix should hit the cache"


def test_repeated_prompt_hits_prefix_cache_and_keeps_output(tiny_llama: Path, kernels: str) -> None:
    engine = make_engine(tiny_llama, kernels=kernels)
    prompt = _prompts(engine.model_config.vocab_size)[5]  # 64 tokens: 4 full blocks
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first = engine.generate([prompt], params)[0]
    second = engine.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48, "3 full blocks (the 4th holds the token that must be recomputed)"
    assert second.token_ids == first.token_ids
