"""``kernels="triton"``: the whole engine through its Triton kernels on CPU, under Triton's interpreter.

One scenario on the tiny Llama runs with ``kernels="torch"`` and with ``kernels="triton"`` and must give the
same greedy tokens: adapters of ranks 4 and 8 and base rows in the same steps, a prompt longer than the
step's token budget (chunked prefill), a request whose first block is served from the prefix cache, and a
pool small enough that a running sequence is preempted and recomputed. The Triton launchers are counted, so
the triton run cannot pass by running torch. The interpreter is about 3000x slower than compiled code,
hence the tiny shapes. Then the setting itself: "triton" on a CPU whose kernels were defined for the
compiler (TRITON_INTERPRET unset when they were imported) is a ConfigError that says what to set.
"""

import os
import random
import subprocess
import sys
from collections import Counter
from functools import wraps
from pathlib import Path

import pytest
import torch
from triton.runtime import JITFunction
from triton.runtime.interpreter import InterpretedFunction

import loraplex_kernels.attention.paged_attention
import loraplex_kernels.attention.paged_attention_triton
import loraplex_kernels.sgmv.sgmv_fused
from engine import Engine, EngineConfig, SamplingParams
from engine.adapters.adapter_layout import plan_layout
from engine.adapters.lora_adapter import load_lora_adapter
from engine.config import ModelConfig
from engine.errors import ConfigError
from loraplex_kernels.backend import KernelBackend, compiled_triton_functions, triton_unavailable_reason
from tests.engine.conftest import make_engine, run_checked
from tests.engine.lora_helpers import make_peft_adapter

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGE_BYTES = 2 * 16 * 2 * 2 * 16 * 4  # the tiny model: layers x block_size x (K, V) x kv_heads x head_dim x fp32
BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 16  # the step's token budget: the 37-token prompt takes three chunks
NUM_KV_PAGES = 6  # pages left for KV next to both adapters: fewer than the running sequences want
ADAPTERS = {"r4": dict(r=4, target_modules="all-linear"), "r8": dict(r=8, target_modules="all-linear")}
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LAUNCHERS = {
    "attention": (loraplex_kernels.attention.paged_attention, "paged_attention_triton"),
    "sgmv_shrink": (loraplex_kernels.sgmv.sgmv_fused, "shrink_partials"),
    "sgmv_expand": (loraplex_kernels.sgmv.sgmv_fused, "expand_partials"),
    # The launcher plans prefill tiles itself only when the step did not: in the engine, never.
    "tiles_planned_per_layer": (loraplex_kernels.attention.paged_attention_triton, "plan_prefill_tiles"),
}


def _requests(vocab_size: int) -> list[tuple[list[int], str | None]]:
    """(prompt, adapter) in arrival order; the fourth shares the first's full first block, with its adapter."""
    rng = random.Random(17)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    shared = tokens(BLOCK_SIZE)
    return [
        (shared + tokens(3), "r4"),
        (tokens(37), None),  # longer than the step's budget: chunked prefill
        (tokens(13), "r8"),
        (shared + tokens(5), "r4"),  # admitted after the first request computed the shared block
        (tokens(14), None),
        (tokens(15), "r8"),
    ]


@pytest.fixture(scope="module")
def adapter_folders(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("triton-adapters")
    return {
        name: make_peft_adapter(tiny_llama, root / name, seed=i, **kwargs)
        for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }


def _engine(folder: Path, adapters: dict[str, Path], kernels: str) -> Engine:
    """An engine with both adapters resident in a pool that leaves NUM_KV_PAGES pages for KV."""
    model = ModelConfig.from_folder(folder)
    page_elems = model.page_elems(model.pick_block_size())
    adapter_pages = sum(
        plan_layout(load_lora_adapter(path, model), model, page_elems).num_pages for path in adapters.values()
    )
    engine = make_engine(
        folder,
        kernels=kernels,
        pool_bytes=(adapter_pages + NUM_KV_PAGES) * PAGE_BYTES,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=4,
        scheduling_policy="fifo",
    )
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    return engine


def _run(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], list[int], Counter, list]:
    """Greedy tokens per request, cached prompt tokens per request, Triton launches by kind, each step's ranks."""
    launches: Counter[str] = Counter()
    for kind, (module, name) in LAUNCHERS.items():
        launcher = getattr(module, name)

        def counted(*args, _launcher=launcher, _kind=kind, **kwargs):
            launches[_kind] += 1
            return _launcher(*args, **kwargs)

        monkeypatch.setattr(module, name, wraps(launcher)(counted))
    step_ranks: list[set[int]] = []  # per forward: the rank of each token run (0: base rows)
    forward = engine.model.forward

    def spy(batch, pool):
        if batch.attention.prefill_tiles is not None and len(batch.attention.prefill_tiles):
            launches["steps_with_tiles"] += 1
        qkv = batch.lora.groups["qkv"].meta if batch.lora is not None else None
        step_ranks.append({max(ranks) for ranks in qkv.ranks_list} if qkv is not None else {0})
        return forward(batch, pool)

    engine.model.forward = spy
    requests = _requests(engine.model_config.vocab_size)
    ids = [engine.add_request(prompt, PARAMS, adapter=adapter) for prompt, adapter in requests]
    finals = run_checked(engine)
    monkeypatch.undo()
    outputs = [finals[request_id] for request_id in ids]
    errors = [o.error for o in outputs if o.error is not None]
    assert not errors, f"requests failed in the engine: {errors}"
    return [o.token_ids for o in outputs], [o.num_cached_tokens for o in outputs], launches, step_ranks


def test_triton_engine_matches_torch_tokens(
    tiny_llama: Path, adapter_folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch_engine = _engine(tiny_llama, adapter_folders, "torch")
    triton_engine = _engine(tiny_llama, adapter_folders, "triton")
    assert torch_engine.kernels is KernelBackend.TORCH
    assert triton_engine.kernels is KernelBackend.TRITON
    longest = max(len(prompt) for prompt, _ in _requests(torch_engine.model_config.vocab_size))
    assert longest > MAX_BATCHED_TOKENS, "no prompt needs chunked prefill"

    torch_tokens, torch_cached, torch_launches, torch_ranks = _run(torch_engine, monkeypatch)
    triton_tokens, triton_cached, triton_launches, triton_ranks = _run(triton_engine, monkeypatch)

    assert not torch_launches, "the torch run launched Triton kernels"
    num_layers = triton_engine.model_config.num_layers
    assert triton_launches["attention"] == len(triton_ranks) * num_layers, "a layer's attention skipped Triton"
    assert triton_launches["sgmv_shrink"] == triton_launches["sgmv_expand"] > 0
    assert triton_launches["steps_with_tiles"] > 0, "no step planned tiles for a prefill chunk of 16 rows or more"
    assert triton_launches["tiles_planned_per_layer"] == 0, "the attention planned tiles per layer, not per step"
    assert triton_ranks == torch_ranks, "the two runs were scheduled differently"
    assert any({0, 4, 8} <= ranks for ranks in triton_ranks), "no step mixed base rows with both adapters"
    for engine, cached in ((torch_engine, torch_cached), (triton_engine, triton_cached)):
        stats = engine.stats()
        assert cached[3] == BLOCK_SIZE, "the shared first block should come from the prefix cache"
        assert stats.num_cached_prompt_tokens >= BLOCK_SIZE
        assert stats.num_preemptions > 0, "the small pool was meant to preempt a running sequence"
    assert all(len(tokens) == PARAMS.max_tokens for tokens in torch_tokens)
    assert triton_tokens == torch_tokens


def test_triton_resolves_on_cpu_under_the_interpreter_and_auto_is_triton_on_cuda() -> None:
    # tests/conftest.py set TRITON_INTERPRET=1 before any kernel was defined.
    assert compiled_triton_functions() == []
    assert triton_unavailable_reason(torch.device("cpu")) is None
    config = EngineConfig(model="unused", kernels="triton")
    assert config.kernel_backend(torch.device("cpu"), torch.float32, 16) is KernelBackend.TRITON
    for setting in ("auto", "triton"):
        cuda = EngineConfig(model="unused", kernels=setting).kernel_backend(torch.device("cuda"), torch.bfloat16, 64)
        assert cuda is KernelBackend.TRITON
    assert (
        EngineConfig(model="unused", kernels="torch").kernel_backend(torch.device("cuda"), torch.bfloat16, 64)
        is KernelBackend.TORCH
    )


def test_a_kernel_defined_for_the_compiler_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check reads the kernel objects: one compiled kernel among interpreted ones is found and named."""
    name, interpreted = next(
        (name, value)
        for name, value in vars(loraplex_kernels.attention.paged_attention_triton).items()
        if isinstance(value, InterpretedFunction) and name.endswith("_kernel")
    )
    monkeypatch.setattr(loraplex_kernels.attention.paged_attention_triton, name, JITFunction(interpreted.fn))
    assert compiled_triton_functions() == [f"loraplex_kernels.attention.paged_attention_triton.{name}"]
    with pytest.raises(
        ConfigError,
        match=rf"kernels='triton' cannot be used: .*kernels\.attention\.paged_attention_triton\.{name} was",
    ):
        EngineConfig(model="unused", kernels="triton").kernel_backend(torch.device("cpu"), torch.float32, 16)


# Imports the kernels without the interpreter, then sets the variable: too late, as the message must say.
_WITHOUT_INTERPRETER = """
import os
import torch
from engine.config import EngineConfig
from engine.errors import ConfigError
os.environ["TRITON_INTERPRET"] = "1"
try:
    EngineConfig(model="unused", kernels="triton").kernel_backend(torch.device("cpu"), torch.float32, 16)
except ConfigError as error:
    raise SystemExit(f"ConfigError: {error}") from None
raise SystemExit("resolved without a ConfigError")
"""


def test_triton_on_cpu_without_the_interpreter_is_a_config_error_that_says_what_to_set() -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_INTERPRETER],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    message = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    assert message.startswith("ConfigError: kernels='triton' cannot be used"), done.stderr
    assert (
        "loraplex_kernels.attention.paged_attention_triton._paged_attention_kernel" in message
        and "defined for the compiler" in message
    )
    assert "set TRITON_INTERPRET=1" in message and "kernels='torch'" in message
