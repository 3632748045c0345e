"""On the real default model, the engine's greedy tokens equal transformers' greedy generate."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.model_store import resolve_model
from app.settings import Settings
from engine import SamplingParams
from tests.engine.conftest import make_engine, run_checked

pytestmark = pytest.mark.default_model

MAX_TOKENS = 24
POOL_BYTES = 256 * 1024**2
PAGE_BYTES = 737_280  # SmolLM2: 30 layers x 16 tokens x 2 x 3 kv heads x 64 x 4 bytes
QUESTIONS = [
    "What is the capital of France?",
    "Write a limerick about a cat who loves lasagna, and explain why it is funny in one sentence.",
    "hi",
    "List the planets of the solar system in order from the sun, with one fact about each of them.",
]
RAW = [
    "The history of the Roman Empire",
    "def quicksort(arr):",
    "Once upon a time",
    "In 1969, Neil Armstrong became the first person to walk on the moon. The mission, called Apollo 11, "
    "was launched from Kennedy Space Center in Florida on July 16. Three astronauts were aboard:",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def model_folder() -> Path:
    settings = Settings.from_env()
    return resolve_model(settings.model, settings.home)


@pytest.fixture(scope="module")
def prompts(model_folder: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    chat = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    chat = [list(ids["input_ids"]) if not isinstance(ids, list) else ids for ids in chat]
    return chat + [tokenizer.encode(text) for text in RAW]


@pytest.fixture(scope="module")
def reference(model_folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    refs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
        refs.append(out[0, len(prompt) :].tolist())
    return refs


def _run(engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    finals = run_checked(engine)
    return [finals[i].token_ids for i in ids]


def test_prompts_cover_lengths_and_chat(prompts: list[list[int]]) -> None:
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 8 and lengths[0] < 10 and lengths[-1] > 48


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="one_batch"),
        pytest.param({"max_num_batched_tokens": 16, "max_num_seqs": 4}, id="chunked_prefill"),
        pytest.param({"pool_bytes": 12 * PAGE_BYTES, "max_num_seqs": 9}, id="preemption"),
    ],
)
def test_greedy_matches_transformers(model_folder, prompts, reference, overrides, kernels) -> None:
    engine = make_engine(model_folder, **{"pool_bytes": POOL_BYTES, "kernels": kernels, **overrides})
    assert _run(engine, prompts) == reference
    if "pool_bytes" in overrides:
        assert engine.stats().num_preemptions > 0, "12 pages for 9 prompts were meant to force preemption"


def test_prefix_cache_hits_keep_greedy_output(model_folder, prompts, reference) -> None:
    engine = make_engine(model_folder, pool_bytes=POOL_BYTES)
    assert _run(engine, prompts) == reference
    before = engine.stats().num_cached_prompt_tokens
    assert _run(engine, prompts) == reference
    cached = engine.stats().num_cached_prompt_tokens - before
    full_blocks = sum((len(p) - 1) // engine.pool.block_size for p in prompts)
    assert cached == full_blocks * engine.pool.block_size, "every full prompt block should be served from cache"
