"""``loraplex doctor``: what to run first on a new machine. One line per check; exit status 1 when one that ran failed.

The checks, in order:

- the device the engine would use: CUDA's name and memory, or the CPU's model and cores;
- the kernel backend the engine would choose there (``EngineConfig.kernel_backend``), and why;
- the precision it would run (LORAPLEX_DTYPE, LORAPLEX_QUANTIZATION): dtypes, weight format, and why;
- each op of a decoder layer run as the engine would run it against its torch implementation on small
  inputs (:mod:`loraplex_kernels.op_checks`), once for the native CPU library and once for CUDA. The side the
  engine does not use here is one skipped line per op, with the reason;
- on CPU, a projection on bf16 and on int8 weights as the engine would prepare them, against float32
  weights, within the stated tolerance of the weights' rounding;
- on the native CPU kernels, attention over bf16 K/V pages and the K/V write into them, and the fused SGMV
  over bf16 adapter rows (what bf16 mode's pool holds), against the same on float32 pages, within the
  stated tolerances of the K/V's and the adapters' rounding;
- a short greedy generate with the configured model (LORAPLEX_MODEL), timed. The default model is never
  downloaded here: when it was not pulled yet the line says how to get it.

Skipped checks do not fail the run. ``--json`` prints the same results for machines.
"""

import os
import platform
import time
from pathlib import Path

import torch

from app.cli.doctor_kernels import check_cuda_ops, check_native_ops, check_pool_formats, check_weight_formats
from app.cli.doctor_results import CheckResult, Status
from app.model_store import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_SPEC,
    ModelStoreError,
    installed_default_model,
    resolve_model,
)
from app.settings import Settings
from engine import Engine, EngineConfig, SamplingParams
from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.modeling.precision import dtype_name
from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.native_cpu import unavailable_reason

GENERATE_PROMPT = "The three primary colours are"
GENERATE_TOKENS = 32
WARMUP_TOKENS = 2  # a first call loads the native library or compiles the Triton kernels: not timed
# The generate needs a few pages; the engine's own default would take 85 % of a GPU's free memory.
POOL_BYTES = 128 * 1024**2
HEAD_DIM_WITHOUT_MODEL = 64  # the default model's, for choosing the backend when no model is at hand
GATE_UP_SHAPE_WITHOUT_MODEL = (3072, 576)  # the default model's, for timing the bf16 GEMMs without a model


def run_doctor(settings: Settings) -> list[CheckResult]:
    """Every check, in the order they are printed."""
    model, model_problem = find_model(settings)
    config = EngineConfig(
        model=str(model or ""),
        pool_bytes=POOL_BYTES,
        dtype=settings.dtype,
        quantization=settings.quantization,
        bf16_gemm=settings.bf16_gemm,
        max_num_seqs=settings.max_num_seqs,
    )
    device = config.torch_device()
    dtype = config.torch_dtype(device)
    model_config = ModelConfig.from_folder(model) if model else None
    head_dim = model_config.head_dim if model_config else HEAD_DIM_WITHOUT_MODEL
    gate_up_shape = model_config.gate_up_shape if model_config else GATE_UP_SHAPE_WITHOUT_MODEL
    backend_check, backend = check_kernel_backend(config, device, dtype, head_dim)
    precision_check = check_precision(config, device, backend, gate_up_shape)
    return [
        check_device(device),
        backend_check,
        precision_check,
        *check_native_ops(device, backend),
        *check_weight_formats(device, backend),
        *check_pool_formats(device, backend),
        *check_cuda_ops(device, dtype, backend),
        model_problem or check_generate(config, model, device, dtype, backend),
    ]


def find_model(settings: Settings) -> tuple[Path | None, CheckResult | None]:
    """The model folder to generate with, or why there is none (a skip when the default was never pulled)."""
    if settings.model == DEFAULT_MODEL_SPEC:
        folder = installed_default_model(settings.home)
        if folder is None:
            return None, CheckResult(
                "generate",
                Status.SKIP,
                f"the default model {DEFAULT_MODEL_NAME} is not in {settings.home / 'models'}: "
                "run `loraplex models pull` (about 93 MB), or set LORAPLEX_MODEL to a model folder",
            )
        return folder, None
    try:
        return resolve_model(settings.model, settings.home), None
    except ModelStoreError as error:
        return None, CheckResult("generate", Status.FAIL, str(error))


def check_device(device: torch.device) -> CheckResult:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        return CheckResult(
            "device",
            Status.PASS,
            f"cuda: {props.name}, compute capability {props.major}.{props.minor}, {total / 2**30:.1f} GiB "
            f"({free / 2**30:.1f} GiB free); torch {torch.__version__}, CUDA {torch.version.cuda}",
            {"device": "cuda", "device_name": props.name, "total_bytes": total, "free_bytes": free},
        )
    cores = os.cpu_count() or 1
    return CheckResult(
        "device",
        Status.PASS,
        f"cpu: {cpu_model()}, {cores} cores; torch {torch.__version__} on {torch.get_num_threads()} threads; "
        "no CUDA device",
        {"device": "cpu", "device_name": cpu_model(), "cores": cores},
    )


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def check_kernel_backend(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, head_dim: int
) -> tuple[CheckResult, KernelBackend | None]:
    """The backend ``kernels='auto'`` resolves to here (building the native library once on CPU), and why."""
    try:
        backend = config.kernel_backend(device, dtype, head_dim)
    except ConfigError as error:
        return CheckResult("kernel backend", Status.FAIL, str(error)), None
    model_dtype = str(dtype).removeprefix("torch.")
    if backend is KernelBackend.TRITON:
        why = f"on CUDA: the Triton kernels for paged attention and SGMV, torch for the other ops, in {model_dtype}"
    elif backend is KernelBackend.NATIVE:
        why = f"on CPU, model in {model_dtype}, and the native C++ library builds here"
    else:
        why = f"the native CPU kernels cannot run: {unavailable_reason() or f'{model_dtype}, head_dim {head_dim}'}"
    result = CheckResult(
        "kernel backend", Status.PASS, f"{backend.value} (kernels='auto' {why})", {"backend": backend.value}
    )
    return result, backend


def check_precision(
    config: EngineConfig, device: torch.device, backend: KernelBackend | None, gate_up_shape: tuple[int, int]
) -> CheckResult:
    """The dtypes, weight format and GEMM of bf16 and int8 weights (timed as the engine times them) the engine
    would run with, and why."""
    if backend is None:
        return CheckResult("precision", Status.SKIP, "no kernel backend could be chosen (see above)")
    try:
        precision = config.precision(device, backend, gate_up_shape)
    except ConfigError as error:
        return CheckResult("precision", Status.FAIL, str(error))
    values = {
        "dtype": dtype_name(precision.dtype),
        "activation_dtype": dtype_name(precision.activation_dtype),
        "kv_dtype": dtype_name(precision.kv_dtype),
        "weight_format": precision.weight_format,
        "bf16_gemm": precision.bf16_gemm or "",
    }
    return CheckResult("precision", Status.PASS, precision.reason, values)


def check_generate(
    config: EngineConfig, model: Path, device: torch.device, dtype: torch.dtype, backend: KernelBackend | None
) -> CheckResult:
    """A greedy generate of GENERATE_TOKENS tokens after a short untimed one; tokens/s end to end."""
    params = SamplingParams(max_tokens=GENERATE_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        started = time.perf_counter()
        engine = Engine(config)
        loaded = time.perf_counter()
        engine.generate([GENERATE_PROMPT], SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True))
        warmed = time.perf_counter()
        output = engine.generate([GENERATE_PROMPT], params)[0]
        elapsed = time.perf_counter() - warmed
    except Exception as error:  # whatever breaks here is what the user must see
        return CheckResult("generate", Status.FAIL, f"{model.name}: {type(error).__name__}: {error}")
    num_tokens = len(output.token_ids)
    rate = num_tokens / elapsed
    where = f"{device.type}/{str(dtype).removeprefix('torch.')}, {backend.value if backend else '?'} kernels"
    return CheckResult(
        "generate",
        Status.PASS if num_tokens == GENERATE_TOKENS else Status.FAIL,
        f"{num_tokens} of {GENERATE_TOKENS} tokens in {elapsed:.2f} s: {rate:.1f} tokens/s ({model.name} on {where}; "
        f"load {loaded - started:.1f} s, first call {warmed - loaded:.2f} s)",
        {"tokens": num_tokens, "seconds": elapsed, "tokens_per_s": rate, "load_s": loaded - started},
    )
