"""On the real default model: greedy outputs are the same token for token with speculation on and off (in bf16,
every logprob the same bits)."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, SamplingParams
from engine.sampling.grammar import GrammarConstraint
from loraplex_kernels.projection.linear_dot import amx_available, dot_available
from tests.engine.conftest import make_engine
from tests.engine.lora_helpers import make_peft_adapter
from tests.engine.test_speculative import generate

pytestmark = pytest.mark.default_model

PAGE_BYTES = 737_280  # SmolLM2: 30 layers x 16 tokens x 2 x 3 kv heads x 64 x 4 bytes
PASSAGE = (
    "The river rises in the northern hills and runs south for three hundred kilometres before it reaches the "
    "sea. Along its banks the old towns kept their mills turning for centuries."
)
TASKS = [
    f"Read this passage:\n\n{PASSAGE}\n\nQuote the passage back word for word.",
    'Rewrite this JSON with "city" changed to "Oslo": {"name": "Ada", "age": 41, "city": "Lima", "job": "pilot"}',
    f"Repeat after me: {PASSAGE}",
]


@pytest.fixture(scope="module")
def folder() -> Path:
    settings = Settings.from_env()
    return resolve_model(settings.model, settings.home)


@pytest.fixture(scope="module")
def prompts(folder: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": task}], tokenize=True, add_generation_prompt=True)
        for task in TASKS
    ]
    return [list(ids["input_ids"]) if not isinstance(ids, list) else ids for ids in chats]


def with_adapters(engine: Engine, adapters: dict[str, Path]) -> Engine:
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    return engine


def test_mixed_adapters_chunked_prefill_cache_hits_and_a_grammar(folder, prompts, tmp_path: Path) -> None:
    adapters = {
        "qv": make_peft_adapter(folder, tmp_path / "qv", seed=5, r=4, target_modules=["q_proj", "v_proj"]),
        "mlp": make_peft_adapter(folder, tmp_path / "mlp", seed=6, r=8, target_modules=["down_proj"]),
    }
    schema = GrammarConstraint.json_schema(
        {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
         "required": ["name", "city"]}
    )
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    params = [greedy, greedy, greedy, SamplingParams(max_tokens=32, temperature=0.0, constraint=schema)]
    batch = [*prompts, prompts[1]]
    names = ["qv", "mlp", None, "qv"]
    config = dict(pool_bytes=256 * 1024**2, max_num_batched_tokens=64)  # every prompt is prefilled in chunks
    plain = generate(with_adapters(make_engine(folder, **config), adapters), batch, params, names)
    engine = with_adapters(make_engine(folder, num_speculative_tokens=5, **config), adapters)
    first = generate(engine, batch, params, names)
    again = generate(engine, batch, params, names)  # the prompts' blocks now come from the prefix cache
    assert engine.stats().num_cached_prompt_tokens > 0
    expected = [out.token_ids for out in plain]
    assert [out.token_ids for out in first] == expected
    assert [out.token_ids for out in again] == expected
    stats = engine.stats()
    assert stats.num_accepted_tokens.get("", 0) > 0 and stats.acceptance_rate > 0.3
    assert set(stats.num_proposed_tokens) >= {"qv", "mlp", ""}


def test_forced_preemption_keeps_the_output(folder, prompts) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    batch = prompts * 2
    config = dict(pool_bytes=22 * PAGE_BYTES)  # six sequences of ~8 pages each: some are preempted
    plain = generate(make_engine(folder, **config), batch, [params] * len(batch))
    engine = make_engine(folder, num_speculative_tokens=5, **config)
    spec = generate(engine, batch, [params] * len(batch))
    assert [out.token_ids for out in spec] == [out.token_ids for out in plain]
    assert engine.stats().num_preemptions > 0
    assert sum(engine.stats().num_accepted_tokens.values()) > 0


@pytest.mark.parametrize("gemm", ["widen", "dot"])
def test_bf16_tokens_and_logprobs_are_the_same_bits_with_speculation(folder, prompts, gemm: str) -> None:
    """bf16 weights and pages (the default precision on a CPU with AVX512-BF16 or AMX), each GEMM this CPU
    runs: verification rows are computed as the decode rows they stand for, so every logprob is the same."""
    if gemm == "dot" and not (dot_available() or amx_available()):
        pytest.skip("no AVX512-BF16 or AMX here")
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=1)] * 2 * len(prompts)
    config = dict(dtype="bfloat16", bf16_gemm=gemm, pool_bytes=128 * 1024**2)
    batch = prompts * 2
    plain = generate(make_engine(folder, **config), batch, params)
    engine = make_engine(folder, num_speculative_tokens=5, **config)
    spec = generate(engine, batch, params)
    assert sum(engine.stats().num_accepted_tokens.values()) > 0

    def bits(out) -> tuple:
        return tuple(out.token_ids), tuple((lp.token_id, lp.logprob, tuple(lp.top)) for lp in out.logprobs)

    assert [bits(out) for out in spec] == [bits(out) for out in plain]
