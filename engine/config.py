"""The engine's frozen configuration and the model facts derived from a Hugging Face folder."""

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.errors import ConfigError
from engine.modeling.bf16_gemm import BF16_GEMM_CHOICES, resolve_bf16_gemm
from engine.modeling.precision import QUANTIZATIONS, Precision, requested_dtype, resolve_precision
from loraplex_kernels.backend import KernelBackend, triton_unavailable_reason
from loraplex_kernels.native_cpu import unavailable_reason

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
MIN_BLOCK_SIZE = 16  # tokens per KV page; smaller pages make the gather index longer for no gain
DEFAULT_CPU_POOL_BYTES = 2 * 1024**3  # room for ~46k tokens of SmolLM2's KV in fp32
DEFAULT_GPU_MEMORY_FRACTION = 0.85  # of the memory left free after the weights are loaded
DEFAULT_HOST_ADAPTER_BYTES = 4 * 1024**3  # about 400 rank-16 all-linear adapters of SmolLM2
SCHEDULING_POLICIES = ("fair", "fifo")
KERNEL_CHOICES = ("auto", "torch", "native", "triton")
NATIVE_HEAD_DIM_MULTIPLE = 8
DEFAULT_SPECULATIVE_TOKENS = 0  # off until a server enables it
DEFAULT_SPECULATIVE_STEP_TOKENS = 32  # the native attention's vectors are 8 floats wide
# A step's token budget when none is given, by device. On CUDA a step of 512 tokens leaves the GPU mostly idle
# (a prompt of 4,000 tokens would be prefilled in 8 steps); 2,048, vLLM's for GPUs under 70 GB, keeps the
# activations of a step well inside the 15 % of free memory the pool leaves.
DEFAULT_STEP_TOKENS = {"cpu": 512, "cuda": 2048}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine needs to start; validated once, never read from the environment."""

    model: str
    """Path to a local Hugging Face folder (Llama, Qwen2 or Mistral) with safetensors weights."""
    device: str = "auto"
    """"auto" (CUDA when present, else CPU), "cpu" or "cuda"."""
    dtype: str = "auto"
    """The model's precision: "float32", "bfloat16", "float16" or "auto" (bf16 on CUDA; on CPU bf16 where the
    CPU computes it natively, AVX512-BF16 or AMX, else fp32). On the native CPU kernels bf16 is the
    projections' weight format and the K/V's in the pool, and activations stay fp32 (engine/modeling/precision.py)."""
    quantization: str | None = None
    """"int8": per-output-row symmetric int8 projection weights, quantized at load (CPU only); None: none."""
    bf16_gemm: str = "auto"
    """The native CPU kernels' GEMM of bf16 and int8 weights: "widen" (k-major panels widened to fp32, fp32
    FMAs; every CPU), "dot" (the weight format's dot products: AVX512-BF16's on bf16-rounded activations for
    bf16 weights, AVX512-VNNI's on activations quantized to int8 per block of 32 for int8 weights; a CPU
    without them is a ConfigError), or "auto" (both timed at load on the gate/up projection at max_num_seqs
    rows where the CPU has both, the faster kept; engine/modeling/bf16_gemm.py). Ignored for fp32 weights and off
    the native kernels."""
    pool_bytes: int | None = None
    """Bytes for the unified page pool; None: a fraction of free GPU memory, or 2 GiB on CPU."""
    block_size: int | None = None
    """Tokens per KV page; None picks the smallest power of two >= 16 whose page holds the widest row."""
    max_num_seqs: int = 64
    """Most sequences running at once (the decode batch size)."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step, shared by decode tokens and prefill chunks; None: 512 on a CPU, 2,048 on CUDA
    (``DEFAULT_STEP_TOKENS``), or ``max_num_seqs`` where that is more."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose token chain was computed before."""
    num_threads: int | None = None
    """torch intra-op threads on CPU; None keeps torch's default."""
    max_host_adapter_bytes: int = DEFAULT_HOST_ADAPTER_BYTES
    """Host-memory cache of validated adapters; beyond it the least recently used are re-read from disk."""
    scheduling_policy: str = "fair"
    """Whose requests go first: "fair" (per-tenant virtual token counters, S-LoRA's VTC) or "fifo"."""
    kernels: str = "auto"
    """The ops' implementation: "triton" (the Triton kernels for paged attention and SGMV, torch for the
    rest; on CPU only under Triton's interpreter, TRITON_INTERPRET=1 set before the kernels are imported),
    "native" (the C++ CPU kernels, built once on first use), "torch", or "auto" (triton on CUDA; on CPU
    native when it builds and the model runs in fp32 or bf16, else torch with a warning)."""

    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
    """k: most tokens proposed per sequence and step by n-gram prompt lookup and verified in the step; 0 turns
    speculative decoding off. The output is the same with or without it (docs/speculative-decoding.md)."""
    prompt_lookup_min: int = 2
    """Shortest suffix of a sequence's tokens looked up in its earlier tokens to propose what followed."""
    prompt_lookup_max: int = 5
    """Longest suffix looked up (the longest that matches wins)."""
    speculative_max_step_tokens: int = DEFAULT_SPECULATIVE_STEP_TOKENS
    """Proposals fill a step only up to this many rows (decode rows and prefill chunks included): beyond it
    the step is compute-bound and extra rows cost more than they save, so busy steps run without."""
    cuda_graphs: bool = True
    """On CUDA with the Triton kernels, decode steps (with or without adapters) replay a CUDA graph captured per
    batch-size bucket instead of launching each kernel from Python (engine/step/decode_graphs.py); ignored elsewhere."""
    launch_ahead: bool | None = None
    """Queue the next decode step's forward pass on the device as soon as a step's tokens are drawn, before the
    host reads them, so the host's work on the step (outputs, scheduling, the next tables) overlaps the device's
    (engine/step/launch_ahead.py). The scheduler decides the same either way. None: on CUDA, where the host and
    the device run apart; on a CPU the pass runs at once, so it gains nothing there."""

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ConfigError(f"num_speculative_tokens must be 0 (off) or positive, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) and prompt_lookup_max ({self.prompt_lookup_max}) "
                "must satisfy 1 <= min <= max"
            )
        if self.speculative_max_step_tokens < 1:
            raise ConfigError(f"speculative_max_step_tokens must be positive, got {self.speculative_max_step_tokens}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto/float32/bfloat16/float16, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ConfigError(
                f"quantization must be unset or one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.bf16_gemm not in BF16_GEMM_CHOICES:
            raise ConfigError(f"bf16_gemm must be one of {', '.join(BF16_GEMM_CHOICES)}, got {self.bf16_gemm!r}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode in one step"
            )
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be 'fair' or 'fifo', got {self.scheduling_policy!r}")
        if self.pool_bytes is not None and self.pool_bytes <= 0:
            raise ConfigError(f"pool_bytes must be positive, got {self.pool_bytes}")
        if self.kernels not in KERNEL_CHOICES:
            raise ConfigError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")

    def torch_device(self) -> torch.device:
        """``device`` resolved: "auto" is CUDA when torch sees a device, else the CPU."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' was asked for but torch sees no CUDA device")
        return torch.device(self.device)

    def step_token_budget(self, device: torch.device) -> int:
        """``max_num_batched_tokens`` resolved for ``device``: the default leaves every running sequence its row."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(DEFAULT_STEP_TOKENS[device.type], self.max_num_seqs)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """The model dtype on ``device`` (``auto`` resolved); the activations' may differ (modeling/precision.py)."""
        return requested_dtype(self.dtype, device)[0]

    def precision(self, device: torch.device, backend: KernelBackend, projection_shape: tuple[int, int]) -> Precision:
        """The dtypes and weight format the engine runs with ``backend`` on ``device``, and why; the GEMM of
        bf16 and int8 weights timed on ``projection_shape`` [out_features, in_features] where ``bf16_gemm``
        is "auto" and the CPU has both."""
        dtype, why = requested_dtype(self.dtype, device)
        precision = resolve_precision(dtype, why, self.quantization, device, backend)
        choice = resolve_bf16_gemm(
            self.bf16_gemm, precision.weight_format, device, backend, projection_shape, self.max_num_seqs
        )
        return precision if choice is None else precision.with_gemm(choice.gemm, choice.reason)

    def kernel_backend(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> KernelBackend:
        """The ``kernels`` setting resolved for this engine; may build the native kernels (once per machine)."""
        if self.kernels == "triton" or (self.kernels == "auto" and device.type == "cuda"):
            reason = triton_unavailable_reason(device)
            if reason is not None:
                raise ConfigError(f"kernels='triton' cannot be used: {reason}; or use kernels='torch' or 'auto'")
            return KernelBackend.TRITON
        if self.kernels == "torch":
            return KernelBackend.TORCH
        if device.type != "cpu":
            reason = f"they run on CPU only and the engine runs on {device.type}"
        elif dtype not in (torch.float32, torch.bfloat16):
            reason = (
                f"they take float32 or bfloat16 models only and the engine runs {str(dtype).removeprefix('torch.')}"
            )
        elif head_dim % NATIVE_HEAD_DIM_MULTIPLE:
            reason = f"they need a head_dim that is a multiple of {NATIVE_HEAD_DIM_MULTIPLE}, the model's is {head_dim}"
        else:
            reason = unavailable_reason()
        if reason is None:
            return KernelBackend.NATIVE
        if self.kernels == "native":
            raise ConfigError(f"kernels='native' cannot be used: {reason}; use kernels='torch' or 'auto'")
        logger.warning("the native CPU kernels cannot be used (%s); running the torch kernels", reason)
        return KernelBackend.TORCH


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shapes of a Llama-family model, read from its config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    raw: dict = field(repr=False, compare=False)

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelConfig":
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"{folder} has no config.json; point the engine at a Hugging Face model folder")
        raw = json.loads(config_path.read_text())
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; use one of {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            # Qwen2 always has q/k/v biases; Llama and Mistral say so in attention_bias.
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
            eos_token_ids=eos_ids,
            raw=raw,
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly: attention here is full, so a sliding window caps the context."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def gate_up_shape(self) -> tuple[int, int]:
        """[out_features, in_features] of a layer's fused gate/up projection, its largest."""
        return 2 * self.intermediate_size, self.hidden_size

    @property
    def widest_row(self) -> int:
        """The longest LoRA row an adapter may store in a page (docs/architecture.md#adapters-in-the-pool)."""
        return max(self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim)

    def page_elems(self, block_size: int) -> int:
        """P: elements of one page in one layer, a KV block of ``block_size`` tokens."""
        return block_size * 2 * self.num_kv_heads * self.head_dim

    def pick_block_size(self) -> int:
        """The smallest block size (from MIN_BLOCK_SIZE, doubling) whose page holds the widest adapter row."""
        block_size = MIN_BLOCK_SIZE
        while self.page_elems(block_size) < self.widest_row:
            block_size *= 2
        return block_size
