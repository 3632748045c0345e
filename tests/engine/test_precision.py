"""The ``dtype`` and ``quantization`` settings: what auto picks, what each mode stores and computes in on each
backend, the reason the engine reports, and that every mode serves the tiny model close to float32."""

from pathlib import Path

import pytest
import torch

from app.settings import Settings, SettingsError
from engine import EngineConfig, SamplingParams
from engine.errors import ConfigError
from engine.modeling import precision as precision_module
from engine.modeling.precision import requested_dtype
from loraplex_kernels import native_cpu
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.projection.linear import WeightLayout
from tests.engine.conftest import make_engine
from tests.engine.lora_helpers import make_peft_adapter

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42]]
LOGPROB_TOLERANCE = 0.25  # |logprob - fp32's| on the tiny random model; the real bounds: bench_quality
GREEDY_TOKENS = 8  # greedy tokens compared with an adapter (the tiny model's top logits are well apart)


@pytest.fixture
def native_built() -> None:
    if native_cpu.native_ops() is None:
        pytest.skip(f"native CPU kernels unavailable here: {native_cpu.unavailable_reason()}")


@pytest.mark.parametrize(("has_bf16", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_picks_bf16_only_where_the_cpu_computes_it(
    monkeypatch: pytest.MonkeyPatch, has_bf16: bool, expected: torch.dtype
) -> None:
    monkeypatch.setattr(precision_module, "cpu_computes_bf16", lambda: has_bf16)
    dtype, why = requested_dtype("auto", torch.device("cpu"))
    assert dtype is expected
    assert ("natively" in why) is has_bf16
    assert requested_dtype("auto", torch.device("cuda"))[0] is torch.bfloat16
    assert requested_dtype("float32", torch.device("cpu"))[0] is torch.float32


def test_cpu_flags_decide_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    precision_module.cpu_computes_bf16.cache_clear()
    try:
        monkeypatch.setattr(precision_module, "cpu_flags", lambda: "avx2 fma avx512f avx512_bf16")
        assert precision_module.cpu_computes_bf16()
        precision_module.cpu_computes_bf16.cache_clear()
        monkeypatch.setattr(precision_module, "cpu_flags", lambda: "avx2 fma avx512f avx512_vnni")
        assert not precision_module.cpu_computes_bf16()
    finally:
        precision_module.cpu_computes_bf16.cache_clear()


def test_bad_values_are_refused_with_what_to_set() -> None:
    with pytest.raises(ConfigError, match="quantization must be unset or one of int8"):
        EngineConfig(model="x", quantization="int4")
    with pytest.raises(ConfigError, match="CPU only"):
        EngineConfig(model="x", quantization="int8").precision(torch.device("cuda"), KernelBackend.TRITON, (64, 32))
    with pytest.raises(SettingsError, match="LORAPLEX_DTYPE"):
        Settings.from_env({"LORAPLEX_DTYPE": "fp8"})
    with pytest.raises(SettingsError, match="LORAPLEX_QUANTIZATION"):
        Settings.from_env({"LORAPLEX_QUANTIZATION": "int4"})
    settings = Settings.from_env({"LORAPLEX_DTYPE": "bfloat16", "LORAPLEX_QUANTIZATION": "int8"})
    assert (settings.dtype, settings.quantization) == ("bfloat16", "int8")
    assert (Settings.from_env({}).dtype, Settings.from_env({}).quantization) == ("auto", None)


def prompt_logprobs(engine) -> list[float]:
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    return [p.logprob for output in engine.generate(PROMPTS, params) for p in output.prompt_logprobs[1:]]


@pytest.mark.parametrize(
    ("kernels", "dtype", "quantization", "activations", "kv", "weights", "layout"),
    [
        ("native", "bfloat16", None, torch.float32, torch.bfloat16, torch.bfloat16, WeightLayout.NATIVE),
        ("native", "float32", "int8", torch.float32, torch.float32, torch.int8, WeightLayout.NATIVE),
        ("native", "bfloat16", "int8", torch.float32, torch.bfloat16, torch.int8, WeightLayout.NATIVE),
        ("torch", "bfloat16", None, torch.bfloat16, torch.bfloat16, None, None),
        ("torch", "bfloat16", "int8", torch.bfloat16, torch.bfloat16, torch.int8, WeightLayout.INT8),
    ],
)
def test_each_mode_stores_what_it_says_and_scores_close_to_float32(
    tiny_llama: Path,
    kernels: str,
    dtype: str,
    quantization: str | None,
    activations: torch.dtype,
    kv: torch.dtype,
    weights: torch.dtype | None,
    layout: WeightLayout | None,
    request: pytest.FixtureRequest,
) -> None:
    if kernels == "native":
        request.getfixturevalue("native_built")
    reference = prompt_logprobs(make_engine(tiny_llama, kernels=kernels))
    engine = make_engine(tiny_llama, kernels=kernels, dtype=dtype, quantization=quantization)
    assert engine.pool.storage.dtype == kv  # one pool: K/V and adapters alike
    assert engine.model.weights.embed.dtype == activations
    qkv = engine.model.weights.layers[0].qkv
    if weights is not None:
        assert (qkv.weight.dtype, qkv.layout) == (weights, layout)
    stats = engine.stats()
    assert stats.weight_format == (quantization or dtype)
    assert stats.activation_dtype == str(activations).removeprefix("torch.")
    assert stats.kv_dtype == str(kv).removeprefix("torch.")
    assert f"{str(kv).removeprefix('torch.')} K/V" in stats.precision_reason
    assert f"{quantization or dtype} weights" in stats.precision_reason
    got = prompt_logprobs(engine)
    assert max(abs(a - b) for a, b in zip(got, reference, strict=True)) <= LOGPROB_TOLERANCE


def test_native_bf16_pool_holds_kv_and_adapters_in_bf16(tiny_llama: Path, native_built: None, tmp_path: Path) -> None:
    """bf16 mode on the native kernels: one bf16 pool with twice the pages of float32 in the same bytes; an
    adapter's pages are its float32 pages rounded to bf16 (nearest even, once, the scale folded in), so it
    takes half the bytes; with it the engine scores close to the float32 engine and to the torch kernels'
    bf16 engine, and greedy decoding with it continues as theirs do."""
    adapter = make_peft_adapter(tiny_llama, tmp_path / "adapter", seed=5, r=8, target_modules="all-linear")
    engines = {
        "float32": make_engine(tiny_llama, kernels="native", dtype="float32"),
        "bfloat16": make_engine(tiny_llama, kernels="native", dtype="bfloat16"),
        "torch_bfloat16": make_engine(tiny_llama, kernels="torch", dtype="bfloat16"),
    }
    fp32, bf16 = engines["float32"], engines["bfloat16"]
    assert bf16.pool.storage.dtype == torch.bfloat16  # K/V and adapters alike
    assert bf16.pool.num_pages == 2 * fp32.pool.num_pages  # the same pool_bytes
    assert bf16.stats().page_bytes * 2 == fp32.stats().page_bytes
    scores, greedy = {}, {}
    for dtype, engine in engines.items():
        engine.add_adapter("a", adapter)
        params = SamplingParams(max_tokens=0, prompt_logprobs=0)
        outputs = engine.generate(PROMPTS * 2, params, adapters=[None, None, "a", "a"])
        scores[dtype] = [p.logprob for output in outputs for p in output.prompt_logprobs[1:]]
        greedy_params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
        greedy[dtype] = engine.generate(PROMPTS, greedy_params, adapters=["a", "a"])
    assert bf16.pool.stats().pages_by_owner["adapter"] > 0  # still resident beside the K/V the batches wrote
    entries = {dtype: engine.adapters.get("a") for dtype, engine in engines.items()}
    assert entries["bfloat16"].layout.num_pages == entries["float32"].layout.num_pages  # P elements a page each
    assert entries["bfloat16"].host_bytes * 2 == entries["float32"].host_bytes
    assert torch.equal(entries["bfloat16"].host, entries["float32"].host.to(torch.bfloat16))
    resident = bf16.pool.storage[entries["bfloat16"].page_ids]  # [pages, L, P], the rows the SGMV op reads
    assert torch.equal(resident, entries["bfloat16"].host)
    assert bf16.adapters.capacity() >= 2 * fp32.adapters.capacity() - 1
    half = len(scores["float32"]) // 2
    assert scores["float32"][:half] != scores["float32"][half:]  # the adapter changes the scores
    for other in ("float32", "torch_bfloat16"):
        diffs = [abs(a - b) for a, b in zip(scores["bfloat16"], scores[other], strict=True)]
        assert max(diffs) <= LOGPROB_TOLERANCE, other
        for ours, theirs in zip(greedy["bfloat16"], greedy[other], strict=True):
            assert ours.token_ids == theirs.token_ids, other
