"""Speculative decoding on the tiny random model: the output is the model's, whatever is proposed.

A random model rarely repeats itself, so n-gram lookup would propose little; these tests replace the
proposer with one that proposes the greedy continuation computed without speculation, with some tokens
changed, so every step verifies proposals that are partly right and partly wrong.
"""

import random
from collections import Counter
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from engine.memory.page_pool import OwnerKind
from engine.sampling.grammar import GrammarConstraint
from engine.speculative.ngram_proposer import propose_ngram
from tests.engine.conftest import check_invariants, make_engine

K = 4
TINY_PAGE_BYTES = 2 * 16 * 2 * 2 * 16 * 4  # layers x block_size x (K, V) x kv heads x head_dim x fp32
PROMPTS = [
    [5, 17, 40, 99, 17, 40, 3, 250, 61],
    [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211, 212, 213, 214, 215, 216, 217, 218, 219, 220],
    [33] * 40,
    [7, 8, 9],
]


def test_ngram_lookup_proposes_what_followed_the_latest_longest_match() -> None:
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 5, 2, 3]
    assert propose_ngram(tokens, 2, 3, 2) == [7, 7]  # "2 3" last followed by 7 7 (the latest match)
    assert propose_ngram([*tokens, 7], 3, 4, 3) == [7, 5, 2]  # "2 3 7" occurs once before
    assert propose_ngram([*tokens, 4], 1, 3, 3) == []  # 4 never occurred before
    assert propose_ngram([1, 2, 1, 2], 2, 2, 5) == [1, 2]  # the proposal may run into the suffix itself
    assert propose_ngram([1, 2, 3, 1, 2], 3, 3, 2) == []  # only a 2-token match: below prompt_lookup_min


class NoisyOracle:
    """Proposes the known continuation of each prompt from the sequence's position, every ``every``-th token changed."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], every: int, vocab: int, seed: int = 0) -> None:
        self.continuations = continuations
        self.every = every
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.num_calls = 0

    def __call__(self, token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
        self.num_calls += 1
        for prompt, continuation in self.continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                draft = list(continuation[done : done + k])
                for i in range(len(draft)):
                    if self.rng.randrange(self.every) == 0:
                        draft[i] = self.rng.randrange(self.vocab)
                return draft
        return []


def speculating(folder: Path, continuations: dict, every: int = 3, **overrides) -> Engine:
    engine = make_engine(folder, num_speculative_tokens=K, **overrides)
    engine.speculator.propose = NoisyOracle(continuations, every, engine.model_config.vocab_size)
    return engine


def generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], adapters=None) -> list:
    """Every choice's final output, request by request, checking the pool's invariants after every step."""
    ids = [
        engine.add_request(p, sp, adapter=a)
        for p, sp, a in zip(prompts, params, adapters or [None] * len(prompts), strict=True)
    ]
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id, output.index] = output
        check_invariants(engine)
    assert engine.pool.stats().pages_by_owner[OwnerKind.KV.value] == 0, "pages leaked after all requests ended"
    return [finals[i, index] for i, sp in zip(ids, params, strict=True) for index in range(sp.n)]


def test_greedy_output_is_the_same_with_proposals_partly_wrong(tiny_llama: Path) -> None:
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    plain = generate(make_engine(tiny_llama), PROMPTS, params)
    continuations = {tuple(p): out.token_ids for p, out in zip(PROMPTS, plain, strict=True)}
    engine = speculating(tiny_llama, continuations)
    spec = generate(engine, PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = engine.speculator.stats
    assert 0 < sum(stats.num_accepted.values()) < sum(stats.num_proposed.values())
    assert engine.stats().num_generated_tokens == 40 * len(PROMPTS)  # output tokens only, never proposals


def test_rejected_proposals_give_their_blocks_back_and_never_reach_the_prefix_cache(tiny_llama: Path) -> None:
    prompt = list(range(100, 131))  # 31 tokens: the first proposal crosses into the third block
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = generate(make_engine(tiny_llama), [prompt], [params])[0]
    wrong = [(t + 1) % 300 for t in plain.token_ids]  # every proposed token is wrong
    engine = make_engine(tiny_llama, num_speculative_tokens=K)
    engine.speculator.propose = NoisyOracle({tuple(prompt): wrong}, 10**9, 320)
    engine.add_request(prompt, params)
    block_size = engine.pool.block_size
    seen_rollback = False
    while engine.has_unfinished_requests():
        [seq] = engine.scheduler.running or [None]
        engine.step()
        check_invariants(engine)
        if seq is not None and seq.finish_reason is None:
            # A wrong proposal adds no token: the blocks held are those of the computed tokens and no more.
            assert len(seq.block_ids) == -(-seq.num_computed_tokens // block_size)
            assert engine.pool.stats().pages_by_owner[OwnerKind.KV.value] == len(seq.block_ids)
            seen_rollback |= seq.num_computed_tokens % block_size != 0
    assert seen_rollback
    assert engine.speculator.stats.num_accepted[""] == 0
    # Only blocks of real tokens were cached: a new request with the same prompt and output hits them all.
    assert engine.pool.stats().pages_by_owner[OwnerKind.PREFIX_CACHE.value] == (len(prompt) + 19) // block_size


def test_seeded_sampling_with_every_rule_is_the_same_with_and_without_speculation(tiny_llama: Path) -> None:
    params = [
        SamplingParams(max_tokens=30, temperature=0.8, top_k=40, top_p=0.9, seed=1, logprobs=2),
        SamplingParams(
            max_tokens=30,
            temperature=1.2,
            min_p=0.05,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            seed=2,
            logit_bias={17: 2.0},
        ),
        SamplingParams(max_tokens=30, temperature=1.0, repetition_penalty=1.3, min_tokens=25, seed=3, n=2),
        SamplingParams(max_tokens=30, temperature=0.0, stop=["e"], logprobs=1),
    ]
    plain = generate(make_engine(tiny_llama), PROMPTS, params)
    first_choices = [out for out in plain if out.index == 0]
    continuations = {tuple(p): out.token_ids for p, out in zip(PROMPTS, first_choices, strict=True)}
    engine = speculating(tiny_llama, continuations, every=4)
    spec = generate(engine, PROMPTS, params)
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
        if a.logprobs is not None:
            assert [x.token_id for x in a.logprobs] == [x.token_id for x in b.logprobs]
            assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-4)
            assert [[t for t, _ in x.top] for x in a.logprobs] == [[t for t, _ in x.top] for x in b.logprobs]
    assert sum(engine.speculator.stats.num_accepted.values()) > 0


def test_sampled_tokens_keep_the_models_distribution(tiny_llama: Path) -> None:
    """Unseeded draws: the frequencies of the first three tokens match the sampler's without speculation.

    The proposal is always the greedy continuation, so accepting it too often (or too rarely) moves mass
    onto (or off) the likeliest tokens, which a chi-square test over 2 x 400 draws sees.
    """
    prompt = PROMPTS[0]
    greedy = generate(make_engine(tiny_llama), [prompt], [SamplingParams(max_tokens=8, temperature=0.0)])[0]
    params = SamplingParams(max_tokens=3, temperature=0.7, ignore_eos=True)
    num_draws = 400

    def draws(engine: Engine) -> Counter:
        outs = engine.generate([prompt] * num_draws, params)
        return Counter(tuple(o.token_ids[1:3]) for o in outs)

    batch = dict(max_num_seqs=200, max_num_batched_tokens=2048)
    engine = make_engine(tiny_llama, num_speculative_tokens=2, speculative_max_step_tokens=2048, **batch)
    engine.speculator.propose = lambda ids, lo, hi, k: greedy.token_ids[len(ids) - len(prompt) :][:k]
    spec, plain = draws(engine), draws(make_engine(tiny_llama, **batch))
    assert sum(engine.speculator.stats.num_accepted.values()) > num_draws // 10
    # Two-sample chi-square over the (2nd, 3rd) token pairs seen at least 10 times in all; the rest pooled.
    keys = [key for key in spec.keys() | plain.keys() if spec[key] + plain[key] >= 10]
    rest = (num_draws - sum(spec[k] for k in keys), num_draws - sum(plain[k] for k in keys))
    cells = [(spec[k], plain[k]) for k in keys] + ([rest] if sum(rest) else [])
    chi2 = sum((a - b) ** 2 / (a + b) for a, b in cells)
    dof = len(cells) - 1
    assert dof >= 3
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, f"chi2 {chi2:.1f} with {dof} degrees of freedom"


def test_a_grammar_masks_every_verified_position_and_rolls_back(tiny_llama: Path) -> None:
    constraint = GrammarConstraint.regex(r"(ab|ba|a b){3,12}")
    params = [SamplingParams(max_tokens=30, temperature=0.0, constraint=constraint)] * 2 + [
        SamplingParams(max_tokens=30, temperature=0.9, seed=4, constraint=constraint)
    ]
    prompts = PROMPTS[:3]
    plain = generate(make_engine(tiny_llama), prompts, params)
    continuations = {tuple(p): out.token_ids for p, out in zip(prompts, plain, strict=True)}
    engine = speculating(tiny_llama, continuations, every=3)
    spec = generate(engine, prompts, params)
    assert [o.text for o in spec] == [o.text for o in plain]
    assert sum(engine.speculator.stats.num_accepted.values()) > 0


def test_preemption_and_chunked_prefill_keep_the_output(tiny_llama: Path) -> None:
    prompts = [list(range(10 + i, 70 + i)) for i in range(6)]
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)] * len(prompts)
    # 30 pages of 16 tokens for six sequences that need 7 each at the end: some are preempted and recomputed.
    overrides = dict(pool_bytes=30 * TINY_PAGE_BYTES, max_num_batched_tokens=32, max_num_seqs=6)
    plain = generate(make_engine(tiny_llama, **overrides), prompts, params)
    continuations = {tuple(p): out.token_ids for p, out in zip(prompts, plain, strict=True)}
    engine = speculating(tiny_llama, continuations, every=5, speculative_max_step_tokens=64, **overrides)
    spec = generate(engine, prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.stats().num_preemptions > 0
