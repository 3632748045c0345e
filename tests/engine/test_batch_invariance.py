"""A request's tokens and logprobs are the same bits whatever runs beside it.

Probe requests (greedy and seeded sampling, with and without an adapter, logprobs on) are run each alone
(an engine of one sequence at a time), then among 64 requests with mixed adapters whose prompts are
prefilled in chunks in the same steps as the probes' decode rows, then with speculation on (k + 1
verification rows a sequence, some proposals wrong), then with speculation on and a pool too small for
the batch, so sequences are preempted and recomputed. The outputs must be identical, logprobs included:
a tiny model's tokens rarely hinge on the last bit, its logprobs always show it. Each weight precision
and GEMM this CPU runs: fp32, bf16 with the widened and the dot-product GEMM, int8 with both; the
native kernels' AVX2 build runs the op-level checks (tests/kernels/test_row_invariance_native.py).
"""

import random
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from loraplex_kernels.projection.linear_dot import amx_available, dot_available
from loraplex_kernels.projection.linear_vnni import vnni_available
from tests.engine.conftest import make_engine
from tests.engine.lora_helpers import make_peft_adapter
from tests.engine.test_speculative import NoisyOracle, generate

NUM_REQUESTS = 64
NUM_PROBES = 8
MAX_TOKENS = 12
K = 5  # proposed tokens a speculating sequence verifies a step
CHUNK_TOKENS = 96  # max_num_batched_tokens: 64 decode rows and prefill chunks of the rest share each step
SMALL_POOL_PAGES = 40  # far fewer pages than 64 sequences hold: the last admitted are preempted
ADAPTERS = (None, "qv", "mlp")

# (dtype, quantization, bf16_gemm): every precision; the dot-product GEMMs where this CPU runs them.
PRECISIONS = [
    pytest.param("float32", None, "widen", id="fp32"),
    pytest.param("bfloat16", None, "widen", id="bf16-widen"),
    pytest.param(
        "bfloat16",
        None,
        "dot",
        id="bf16-dot",
        marks=pytest.mark.skipif(not (dot_available() or amx_available()), reason="no AVX512-BF16 or AMX here"),
    ),
    pytest.param("float32", "int8", "widen", id="int8-widen"),
    pytest.param(
        "float32",
        "int8",
        "dot",
        id="int8-vnni",
        marks=pytest.mark.skipif(not vnni_available(), reason="no AVX512-VNNI here"),
    ),
]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("invariance-adapters")
    return {
        "qv": make_peft_adapter(tiny_llama, folder / "qv", seed=3, r=4, target_modules=["q_proj", "v_proj"]),
        "mlp": make_peft_adapter(tiny_llama, folder / "mlp", seed=4, r=8, target_modules=["down_proj", "up_proj"]),
    }


def workload() -> tuple[list[list[int]], list[SamplingParams], list[str | None]]:
    """64 requests, the probes last (so they are admitted last and preempted first when pages run out)."""
    rng = random.Random(0)
    prompts, params, names = [], [], []
    for i in range(NUM_REQUESTS):
        length = rng.randrange(16, 48) if i < NUM_REQUESTS - NUM_PROBES else rng.randrange(8, 40)
        motif = [rng.randrange(3, 300) for _ in range(rng.randrange(3, 9))]  # repeated: n-gram proposals match
        prompts.append([motif[j % len(motif)] if rng.random() < 0.7 else rng.randrange(3, 300) for j in range(length)])
        seeded = i % 2 == 1
        params.append(
            SamplingParams(
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                logprobs=2,
                temperature=0.8 if seeded else 0.0,
                seed=1000 + i if seeded else None,
            )
        )
        names.append(ADAPTERS[i % len(ADAPTERS)])
    return prompts, params, names


def engine_with(folder: Path, adapters: dict[str, Path], precision: tuple, **overrides) -> Engine:
    dtype, quantization, gemm = precision
    engine = make_engine(folder, dtype=dtype, quantization=quantization, bf16_gemm=gemm, kernels="native", **overrides)
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    return engine


def signature(output) -> tuple:
    """What a client sees of a choice: its tokens and every logprob, bit for bit."""
    return tuple(output.token_ids), tuple((lp.token_id, lp.logprob, tuple(lp.top)) for lp in output.logprobs)


@pytest.mark.parametrize(("dtype", "quantization", "gemm"), PRECISIONS)
def test_a_request_gets_the_same_output_alone_in_a_batch_speculated_and_preempted(
    tiny_llama: Path, adapters: dict[str, Path], dtype: str, quantization: str | None, gemm: str
) -> None:
    precision = (dtype, quantization, gemm)
    prompts, params, names = workload()
    probes = slice(NUM_REQUESTS - NUM_PROBES, NUM_REQUESTS)
    alone_engine = engine_with(tiny_llama, adapters, precision, max_num_seqs=1, pool_bytes=8 * 1024**2)
    alone = [signature(out) for out in generate(alone_engine, prompts[probes], params[probes], names[probes])]
    continuations = {tuple(p): list(s[0]) for p, s in zip(prompts[probes], alone, strict=True)}

    def batch(**overrides) -> tuple[list[tuple], Engine]:
        engine = engine_with(
            tiny_llama, adapters, precision, max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=CHUNK_TOKENS, **overrides
        )
        if engine.config.num_speculative_tokens:
            engine.speculator.propose = NoisyOracle(continuations, 3, engine.model_config.vocab_size)
        outputs = generate(engine, prompts, params, names)
        return [signature(out) for out in outputs[probes]], engine

    in_batch, _ = batch(pool_bytes=8 * 1024**2, num_speculative_tokens=0)
    assert in_batch == alone, "a probe's output changed in a batch of 64"

    speculated, engine = batch(pool_bytes=8 * 1024**2, num_speculative_tokens=K)
    assert sum(engine.stats().num_accepted_tokens.values()) > 0
    assert speculated == alone, "a probe's output changed with speculation on"

    page_bytes = engine.stats().page_bytes
    preempted, engine = batch(pool_bytes=SMALL_POOL_PAGES * page_bytes, num_speculative_tokens=K)
    assert engine.stats().num_preemptions > 0
    assert preempted == alone, "a probe's output changed after a preemption"
