"""The batched sampler against a row-by-row reference on random logits: penalties, logit_bias, min_tokens, cuts."""

import random

import pytest
import torch

from engine.sampling.sampler import apply_logit_rules, sample
from engine.sampling.sampling_batch import build_sampling_batch
from engine.sampling.sampling_params import SamplingParams
from engine.scheduling.sequence import Sequence
from engine.speculative.verification import DraftPosition

VOCAB = 97  # odd, so no row of ones lines up with anything
EOS = 3


def _seq(params: SamplingParams, rng: random.Random, num_prompt: int = 9, num_output: int = 6) -> Sequence:
    prompt = [rng.randrange(VOCAB) for _ in range(num_prompt)]
    seq = Sequence("r", prompt, params, detokenizer=None, eos_token_ids=frozenset({EOS}))  # type: ignore[arg-type]
    seq.token_ids += [rng.randrange(8) for _ in range(num_output)]  # few distinct ids: repeats to count
    return seq


def _reference(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The same rules, one row and one token at a time, as OpenAI and vLLM define them."""
    out = logits.clone().double()
    for row, seq in enumerate(seqs):
        p = seq.params
        for token, bias in p.logit_bias:
            out[row, token] += bias
        if seq.num_output_tokens < p.min_tokens:
            for token in {*p.stop_token_ids, *(() if p.ignore_eos else seq.eos_token_ids)}:
                out[row, token] = float("-inf")
        for token in set(seq.token_ids):
            if p.repetition_penalty != 1.0:
                value = out[row, token]
                out[row, token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token in set(seq.output_token_ids):
            count = seq.output_token_ids.count(token)
            out[row, token] -= p.frequency_penalty * count + p.presence_penalty
    return out.float()


ROW_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(presence_penalty=1.5, frequency_penalty=-0.7),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=2.0, logit_bias={5: 100.0, 6: -100.0, 90: 3.5}),
    SamplingParams(min_tokens=10, max_tokens=20, stop_token_ids=(7, 8)),
    SamplingParams(min_tokens=10, max_tokens=20, ignore_eos=True, logit_bias={EOS: 2.0}),
    SamplingParams(min_tokens=3, max_tokens=20),  # reached: nothing banned
    SamplingParams(top_k=4, logprobs=3),
]


@pytest.mark.parametrize("trial", range(5))
def test_logit_rules_match_the_reference(trial: int) -> None:
    rng = random.Random(trial)
    seqs = [_seq(p, rng) for p in ROW_PARAMS]
    logits = torch.randn(len(seqs), VOCAB) * 3  # [rows, vocab]
    batch = build_sampling_batch(seqs, VOCAB, torch.device("cpu"))
    got = apply_logit_rules(logits.clone(), batch)
    torch.testing.assert_close(got, _reference(logits, seqs), rtol=1e-5, atol=1e-5)
    tokens = sample(logits.clone(), batch).token_ids
    reference = _reference(logits, seqs)
    for row, seq in enumerate(seqs):
        if seq.params.greedy:
            assert tokens[row] == int(reference[row].argmax())
    assert tokens[4] not in (EOS, 7, 8) and tokens[5] != 6


def test_penalty_counts_follow_the_tokens_appended_between_steps() -> None:
    """A sequence's counts are brought up to date from its last step's: still the reference's after more tokens,
    and a speculating row's position counts the proposed tokens before it without changing its sequence's."""
    rng = random.Random(5)
    seqs = [_seq(p, rng) for p in ROW_PARAMS]
    for num_new in (1, 4, 0, 7):
        for seq in seqs:
            seq.token_ids += [rng.randrange(12) for _ in range(num_new)]
        logits = torch.randn(len(seqs), VOCAB) * 3  # [rows, vocab]
        got = apply_logit_rules(logits.clone(), build_sampling_batch(seqs, VOCAB, torch.device("cpu")))
        torch.testing.assert_close(got, _reference(logits, seqs), rtol=1e-5, atol=1e-5)

    seq = seqs[3]  # repetition and frequency penalties
    draft = (40, 41, 40)
    position = DraftPosition(seq, draft, offset=2)
    proposed = _seq(seq.params, rng, num_output=0)
    proposed.token_ids[:] = [*seq.token_ids, *draft[:2]]
    proposed.prompt_token_ids = seq.prompt_token_ids
    logits = torch.randn(2, VOCAB) * 3  # [2, vocab]
    got = apply_logit_rules(logits.clone(), build_sampling_batch([position, seq], VOCAB, torch.device("cpu")))
    torch.testing.assert_close(got, _reference(logits, [proposed, seq]), rtol=1e-5, atol=1e-5)


def test_rows_without_a_repetition_penalty_send_no_factor_and_still_match_the_reference() -> None:
    rng = random.Random(6)
    params = [SamplingParams(presence_penalty=0.4), SamplingParams(temperature=0), SamplingParams(frequency_penalty=1)]
    seqs = [_seq(p, rng) for p in params]
    batch = build_sampling_batch(seqs, VOCAB, torch.device("cpu"))
    assert batch.penalties is not None and batch.penalties.repetition is None
    logits = torch.randn(len(seqs), VOCAB) * 3  # [rows, vocab]
    torch.testing.assert_close(apply_logit_rules(logits.clone(), batch), _reference(logits, seqs), rtol=0, atol=1e-6)


def test_penalties_built_for_another_vocabulary_width_are_refused() -> None:
    seq = _seq(SamplingParams(frequency_penalty=0.5), random.Random(7))
    batch = build_sampling_batch([seq], VOCAB, torch.device("cpu"))
    with pytest.raises(ValueError, match=f"logits are {VOCAB + 1} wide, the penalties were built for {VOCAB}"):
        apply_logit_rules(torch.zeros(1, VOCAB + 1), batch)


def test_a_penalty_follows_the_exact_count_of_a_long_output() -> None:
    """What a token's count takes off its logit is computed from the count, so thousands of repeats do not drift."""
    params = SamplingParams(frequency_penalty=0.1, presence_penalty=0.3)
    seq = Sequence("r", [1, 2], params, detokenizer=None, eos_token_ids=frozenset({EOS}))  # type: ignore[arg-type]
    for _ in range(3):
        seq.token_ids += [5] * 1000 + [6]
        logits = torch.zeros(1, VOCAB)  # [1, vocab]
        got = apply_logit_rules(logits, build_sampling_batch([seq], VOCAB, torch.device("cpu")))
    assert got[0, 5].item() == torch.tensor(-(0.1 * 3000 + 0.3), dtype=torch.float32).item()
    assert got[0, 6].item() == torch.tensor(-(0.1 * 3 + 0.3), dtype=torch.float32).item()
    assert got[0, 1].item() == 0.0  # a prompt token: not output


def test_a_step_without_rules_builds_nothing_and_returns_the_logits_untouched() -> None:
    rng = random.Random(1)
    seqs = [_seq(SamplingParams(temperature=t), rng) for t in (0.0, 0.7, 1.0)]
    batch = build_sampling_batch(seqs, VOCAB, torch.device("cpu"))
    assert batch.penalties is None and batch.logit_bias is None and batch.banned is None
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None and not batch.logprob_rows
    logits = torch.randn(3, VOCAB)
    assert apply_logit_rules(logits, batch) is logits


def test_cuts_keep_draws_inside_the_allowed_tokens() -> None:
    """top-k, top-p and min-p over many draws: every token drawn is one the reference allows, and most of them are."""
    rng = random.Random(2)
    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.6), SamplingParams(min_p=0.2), SamplingParams(top_k=1)]
    seqs = [_seq(p, rng, num_output=0) for p in params]
    logits = torch.randn(len(seqs), VOCAB) * 2
    probs = logits.softmax(-1)
    order = probs.argsort(dim=-1, descending=True)
    allowed = [
        set(order[0, :5].tolist()),
        set(order[1, : int((probs[1, order[1]].cumsum(0) < 0.6).sum()) + 1].tolist()),
        {t for t in range(VOCAB) if probs[2, t] >= 0.2 * probs[2].max()},
        {int(order[3, 0])},
    ]
    seen: list[set[int]] = [set() for _ in seqs]
    batch = build_sampling_batch(seqs, VOCAB, torch.device("cpu"))
    for _ in range(300):
        for row, token in enumerate(sample(logits.clone(), batch).token_ids):
            assert token in allowed[row], (row, token)
            seen[row].add(token)
    assert all(len(s) >= len(a) - 1 for s, a in zip(seen, allowed, strict=True))


def test_logprobs_are_the_models_own_before_any_rule() -> None:
    rng = random.Random(3)
    params = SamplingParams(temperature=0.0, logprobs=4, presence_penalty=2.0, logit_bias={11: 50.0})
    seqs = [_seq(params, rng), _seq(SamplingParams(temperature=0.0), rng)]
    logits = torch.randn(2, VOCAB)
    out = sample(logits.clone(), build_sampling_batch(seqs, VOCAB, torch.device("cpu")))
    assert out.token_ids[0] == 11 and out.logprobs[1] is None
    raw = logits[0].log_softmax(-1)
    entry = out.logprobs[0]
    assert entry.token_id == 11 and entry.logprob == pytest.approx(raw[11].item(), abs=1e-6)
    top_values, top_ids = raw.topk(4)
    assert [t for t, _ in entry.top] == top_ids.tolist()
    assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-6)


def test_seeded_rows_draw_the_same_whatever_runs_beside_them() -> None:
    rng = random.Random(4)
    logits = torch.randn(1, VOCAB).expand(3, VOCAB) * 0.3  # flat enough that draws differ  # [3, vocab]

    def draws(seeded_row: int, others: int | None) -> list[int]:
        """Ten draws of a row seeded 123, beside rows with other seeds (or none)."""
        seqs = [_seq(SamplingParams(top_p=0.9, seed=None if others is None else others + i), rng) for i in range(3)]
        seqs[seeded_row] = _seq(SamplingParams(top_p=0.9, seed=123), rng)
        batch = build_sampling_batch(seqs, VOCAB, torch.device("cpu"))
        return [sample(logits.clone(), batch).token_ids[seeded_row] for _ in range(10)]

    first = draws(0, 7)
    assert first == draws(0, 99) == draws(2, 5) == draws(1, None)
    assert len(set(first)) > 1
