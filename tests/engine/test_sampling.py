"""Sampling and stopping rules, seen from the outputs a caller gets."""

import json
import shutil
from pathlib import Path

import pytest

from engine import RequestError, SamplingParams
from tests.engine.conftest import make_engine, run_checked

PROMPT = "The quick brown fox"


def _generate(folder: Path, params: list[SamplingParams], prompts: list[str] | None = None):
    engine = make_engine(folder)
    prompts = prompts or [PROMPT] * len(params)
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    finals = run_checked(engine)
    return [finals[i] for i in ids]


def test_seeded_sampling_is_reproducible_whatever_runs_beside_it(tiny_llama: Path) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = _generate(tiny_llama, [seeded])[0]
    other = SamplingParams(max_tokens=9, temperature=1.3, seed=7, ignore_eos=True)
    crowded = _generate(tiny_llama, [other, seeded, other], ["Paged attention", PROMPT, "def add"])[1]
    assert crowded.token_ids == alone.token_ids
    different = _generate(tiny_llama, [SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)])
    assert different[0].token_ids != alone.token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(tiny_llama: Path) -> None:
    greedy, top_k, top_p, least_top_p = _generate(
        tiny_llama,
        [
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-6, seed=4, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=1.0, top_p=5e-324, seed=5, ignore_eos=True),  # 0 in fp32
        ],
    )
    assert top_k.token_ids == greedy.token_ids
    assert top_p.token_ids == greedy.token_ids
    assert least_top_p.token_ids == greedy.token_ids


def test_max_tokens_and_stop_token_ids(tiny_llama: Path) -> None:
    greedy = _generate(tiny_llama, [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)])[0]
    assert len(greedy.token_ids) == 10 and greedy.finish_reason == "length"
    stop_id = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_id)
    stopped = _generate(
        tiny_llama, [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,))]
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == greedy.token_ids[: first + 1]


def test_stop_string_cuts_the_text_before_it(tiny_llama: Path) -> None:
    greedy = _generate(tiny_llama, [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)])[0]
    text = greedy.text
    assert len(text) > 6
    stop = text[3:6]
    engine = make_engine(tiny_llama)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    request_id = engine.add_request(PROMPT, params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.delta_text for o in engine.step() if o.request_id == request_id]
    cut = text[: text.find(stop)]
    assert "".join(deltas) == cut, "streamed deltas must add up to the text and never show the stop string"


def test_eos_ends_the_request_unless_ignored(tiny_llama: Path, tmp_path: Path) -> None:
    greedy = _generate(tiny_llama, [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)])[0]
    eos = greedy.token_ids[5]
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    ended = _generate(folder, [SamplingParams(max_tokens=12, temperature=0.0)])[0]
    assert ended.finish_reason == "stop"
    assert ended.token_ids == greedy.token_ids[: greedy.token_ids.index(eos) + 1]
    ignored = _generate(folder, [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)])[0]
    assert ignored.token_ids == greedy.token_ids and ignored.finish_reason == "length"


def test_bad_requests_are_refused_with_a_reason(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(RequestError, match="context"):
        engine.add_request([5] * 1000, SamplingParams(max_tokens=100))
    with pytest.raises(RequestError, match="unknown adapter"):
        engine.add_request("hi", SamplingParams(), adapter="pirate")
