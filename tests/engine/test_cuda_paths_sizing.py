"""The engine's CUDA choices with the device factored out: the pool sized from free GPU memory (the free bytes
given, or torch.cuda.mem_get_info faked), bf16 and the Triton kernels by default, CUDA asked for without a GPU."""

import pytest
import torch

from engine.config import DEFAULT_CPU_POOL_BYTES, DEFAULT_GPU_MEMORY_FRACTION, EngineConfig, ModelConfig
from engine.errors import ConfigError
from engine.memory import page_pool
from engine.memory.page_pool import make_pool, page_bytes, size_pool
from engine.modeling.precision import cpu_computes_bf16
from loraplex_kernels.backend import KernelBackend

# SmolLM2-135M's shapes: 30 layers, 3 kv heads of 64, rows up to 1536 wide, a context of 8192 tokens.
SMOLLM2 = ModelConfig.from_dict(
    {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    }
)
BLOCK_SIZE = 16  # the smallest power of two >= 16 whose page (16 x 2 x 3 x 64 = 6144) holds a 1536 row
BF16_PAGE_BYTES = 30 * BLOCK_SIZE * 2 * 3 * 64 * 2  # 368,640
CONTEXT_PAGES = 8192 // BLOCK_SIZE  # one sequence of the whole context
GIB = 2**30
CONFIG = EngineConfig(model="unused")


def test_page_bytes_per_dtype() -> None:
    assert SMOLLM2.pick_block_size() == BLOCK_SIZE
    assert page_bytes(SMOLLM2, BLOCK_SIZE, torch.bfloat16) == BF16_PAGE_BYTES
    assert page_bytes(SMOLLM2, BLOCK_SIZE, torch.float16) == BF16_PAGE_BYTES
    assert page_bytes(SMOLLM2, BLOCK_SIZE, torch.float32) == 2 * BF16_PAGE_BYTES
    assert page_bytes(SMOLLM2, 32, torch.bfloat16) == 2 * BF16_PAGE_BYTES


@pytest.mark.parametrize("free_gib", [0.5, 8, 79.3])
def test_gpu_pool_is_a_fraction_of_free_memory(free_gib: float) -> None:
    free = int(free_gib * GIB)
    size = size_pool(CONFIG, SMOLLM2, torch.bfloat16, free_device_bytes=free)
    assert DEFAULT_GPU_MEMORY_FRACTION == 0.85
    assert size.budget_bytes == int(free * 0.85)
    assert size.page_bytes == BF16_PAGE_BYTES and size.block_size == BLOCK_SIZE
    assert size.num_pages == int(free * 0.85) // BF16_PAGE_BYTES
    assert size.num_pages * BF16_PAGE_BYTES <= free * 0.85 < (size.num_pages + 1) * BF16_PAGE_BYTES


def test_8_gib_free_holds_about_317k_tokens_in_bf16() -> None:
    size = size_pool(CONFIG, SMOLLM2, torch.bfloat16, free_device_bytes=8 * GIB)
    assert size.num_pages == 19806  # 0.85 x 8 GiB / 368,640 bytes
    fp32 = size_pool(CONFIG, SMOLLM2, torch.float32, free_device_bytes=8 * GIB)
    assert fp32.num_pages == 19806 // 2


def test_explicit_pool_bytes_and_the_cpu_default_ignore_free_memory() -> None:
    explicit = EngineConfig(model="unused", pool_bytes=10 * BF16_PAGE_BYTES + 5)
    assert size_pool(explicit, SMOLLM2, torch.bfloat16, free_device_bytes=80 * GIB).num_pages == 10
    cpu = size_pool(CONFIG, SMOLLM2, torch.float32, free_device_bytes=None)
    assert cpu.budget_bytes == DEFAULT_CPU_POOL_BYTES
    assert cpu.num_pages == DEFAULT_CPU_POOL_BYTES // (2 * BF16_PAGE_BYTES)


def test_too_little_free_gpu_memory_for_one_full_sequence_is_a_config_error() -> None:
    just_enough = -(-CONTEXT_PAGES * BF16_PAGE_BYTES * 100 // 85)  # free bytes whose 85 % hold 512 pages
    assert size_pool(CONFIG, SMOLLM2, torch.bfloat16, free_device_bytes=just_enough).num_pages == CONTEXT_PAGES
    with pytest.raises(ConfigError) as error:
        size_pool(CONFIG, SMOLLM2, torch.bfloat16, free_device_bytes=just_enough - BF16_PAGE_BYTES)
    message = str(error.value)
    assert "511 pages" in message and "at least 512" in message and "8192 tokens" in message
    assert "free GPU memory" in message and f"pool_bytes (at least {CONTEXT_PAGES * BF16_PAGE_BYTES})" in message


def test_pool_bytes_below_one_page_is_a_config_error() -> None:
    tiny = EngineConfig(model="unused", pool_bytes=BF16_PAGE_BYTES - 1)
    with pytest.raises(ConfigError, match=f"0 pages .* at least 1: give pool_bytes at least {BF16_PAGE_BYTES}"):
        size_pool(tiny, SMOLLM2, torch.bfloat16, free_device_bytes=None)
    one = EngineConfig(model="unused", pool_bytes=BF16_PAGE_BYTES)
    assert size_pool(one, SMOLLM2, torch.bfloat16, free_device_bytes=None).num_pages == 1


def test_make_pool_reads_free_memory_on_cuda_only_without_pool_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[torch.device] = []
    built: list[tuple] = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return 3 * GIB, 80 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(page_pool, "PagePool", lambda *args: built.append(args))
    cuda = torch.device("cuda", 0)
    make_pool(CONFIG, SMOLLM2, torch.bfloat16, cuda)
    assert asked == [cuda]
    assert built[-1] == (int(3 * GIB * 0.85) // BF16_PAGE_BYTES, 30, BLOCK_SIZE, 3, 64, torch.bfloat16, cuda)
    make_pool(EngineConfig(model="unused", pool_bytes=GIB), SMOLLM2, torch.bfloat16, cuda)
    make_pool(CONFIG, SMOLLM2, torch.float32, torch.device("cpu"))
    assert asked == [cuda], "an explicit pool_bytes, or the CPU, never asks the GPU"


def test_cuda_defaults_to_bf16_and_the_triton_kernels() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert CONFIG.torch_dtype(cuda) is torch.bfloat16
    assert CONFIG.torch_dtype(cpu) is (torch.bfloat16 if cpu_computes_bf16() else torch.float32)
    assert EngineConfig(model="unused", dtype="float32").torch_dtype(cpu) is torch.float32
    assert EngineConfig(model="unused", dtype="float16").torch_dtype(cuda) is torch.float16
    assert EngineConfig(model="unused", dtype="float32").torch_dtype(cuda) is torch.float32
    assert CONFIG.kernel_backend(cuda, torch.bfloat16, 64) is KernelBackend.TRITON


def test_a_step_takes_2048_tokens_on_cuda_and_512_on_a_cpu_unless_told_or_more_sequences_run() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert (CONFIG.step_token_budget(cuda), CONFIG.step_token_budget(cpu)) == (2048, 512)
    many = EngineConfig(model="unused", max_num_seqs=4096)
    assert (many.step_token_budget(cuda), many.step_token_budget(cpu)) == (4096, 4096)
    told = EngineConfig(model="unused", max_num_batched_tokens=96)
    assert (told.step_token_budget(cuda), told.step_token_budget(cpu)) == (96, 96)
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(96\) must be at least max_num_seqs \(128\)"):
        EngineConfig(model="unused", max_num_seqs=128, max_num_batched_tokens=96)


def test_auto_device_follows_cuda_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert CONFIG.torch_device() == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert CONFIG.torch_device() == torch.device("cpu")
    with pytest.raises(ConfigError, match="no CUDA device"):
        EngineConfig(model="unused", device="cuda").torch_device()
