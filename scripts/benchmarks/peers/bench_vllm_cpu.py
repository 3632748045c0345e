"""loraplex against vLLM-CPU on the same workload, side by side in one run, as ratios: engine level and HTTP level.

The workload: 64 requests, prompts of 64 to 128 random tokens, 64 output tokens each,
greedy, ``ignore_eos``, all submitted at once, in ``--dtype`` (float32 unless told; both engines alike:
``--dtype bfloat16`` runs vLLM-CPU in bf16, its default on a CPU that computes bf16, against loraplex in
bf16), the default model; adapters are rank 8 on all
seven linear modules (synthetic PEFT folders written once under the data folder), request i using
adapter i mod k. Cases: the base model, and k = 1, 8, 16 adapters.

Engine level (``--level engine``): each engine's Python API in a process of its own. vLLM with LoRA off
(its compiled default) for the base model and with LoRA on (eager, ``max_loras`` 16) for the adapters;
vLLM's LoRA-on engine also runs the base model, for reference. Every measurement is a fresh process for
vLLM (its scratch environment, see ``vllm_cpu_env.py``; tuned as its docs advise) and a fresh engine for
loraplex, after a warm-up.

HTTP level (``--level http``, see ``bench_http_level.py``): the same requests as concurrent streamed
``/v1/completions`` requests to vLLM's OpenAI server (LoRA off for the base model, LoRA on for the
adapters) and to ``loraplex serve``, once per ``--http-engines`` setting of ``LORAPLEX_ENGINE``; the
ratios ``http_*_vs_vllm_server`` are the first setting's, ``http_*_process_vs_thread`` compare the two.

The cases run --repeats times, round after round, each round both levels (so a drift of the machine's
speed over the run touches both alike; at the HTTP level the servers' order reverses every other round),
and each figure is the median of its rounds. With both levels and vLLM, ``*_http_vs_engine_*`` say what
each engine keeps of its engine-level rate through its server.

``--without-amx`` runs both engines as on a CPU with AVX512-BF16 and VNNI but no AMX tiles (AMD Zen 4):
loraplex's kernels built for that instruction set (``LORAPLEX_NATIVE_MARCH=cooperlake``), oneDNN (torch's
and vLLM's) capped at ``AVX512_CORE_BF16``, and vLLM's own AMX kernels off (``vllm_without_amx/``). On a CPU
with AMX it estimates what the two engines do on one without; the instructions' speeds are this CPU's.

    python -m scripts.benchmarks.peers.bench_vllm_cpu --json  # last line: one JSON object (both levels: ~25 min here)
    python -m scripts.benchmarks.peers.bench_vllm_cpu --level http --http-engines process,thread --repeats 3 --json
"""

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from app.model_store import resolve_model
from app.settings import ENGINE_KINDS, Settings
from engine import Engine, EngineConfig, SamplingParams
from engine.adapters.lora_config import PROJECTIONS
from engine.config import ModelConfig
from loraplex_kernels.native_cpu import MARCH_ENV, cpu_flags
from scripts.benchmarks.engine.bench_lora import write_synthetic_adapter
from scripts.benchmarks.peers.bench_http_level import on_loraplex, on_vllm, run_case
from scripts.benchmarks.peers.vllm_cpu_env import WITHOUT_AMX_ENV, VllmEnv, ensure_vllm_env

DEFAULT_HTTP_ENGINES = ("process", "thread")  # the two engines of one machine, side by side
logger = logging.getLogger("bench_vllm_cpu")

RANK = 8
ADAPTER_COUNTS = (1, 8, 16)
WORKER = Path(__file__).with_name("vllm_cpu_worker.py")
LEVELS = ("engine", "http", "both")
WITHOUT_AMX = {  # both engines as on a CPU with AVX512-BF16 and VNNI and no AMX tiles
    MARCH_ENV: "cooperlake",  # loraplex's kernels: AVX-512 with BF16 and VNNI, no AMX
    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",  # oneDNN's GEMMs, torch's and vLLM's alike
    WITHOUT_AMX_ENV: "1",  # vLLM's own AMX kernels off (vllm_cpu_env.py)
}


def make_workload(
    vocab_size: int, num_requests: int, max_tokens: int, adapters: list[Path], seed: int, dtype: str = "float32"
) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab_size - 100) for _ in range(rng.randint(64, 128))] for _ in range(num_requests)]
    adapter_paths = [str(a) for a in adapters]
    return {"prompts": prompts, "max_tokens": max_tokens, "rank": RANK, "adapters": adapter_paths, "dtype": dtype}


def run_loraplex(folder: Path, workload: dict, num_adapters: int) -> float:
    """Output tok/s of a fresh engine on the workload, request i on adapter i mod ``num_adapters`` (0: base)."""
    engine = Engine(EngineConfig(model=str(folder), max_num_seqs=64, dtype=workload["dtype"]))
    names = [f"a{i}" for i in range(num_adapters)]
    for name, path in zip(names, workload["adapters"], strict=False):
        engine.add_adapter(name, path)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate(workload["prompts"][:2], warm, adapters=[names[0] if names else None, None])
    params = SamplingParams(max_tokens=workload["max_tokens"], temperature=0.0, ignore_eos=True)
    before = engine.stats().num_generated_tokens
    start = time.perf_counter()
    for index, prompt in enumerate(workload["prompts"]):
        engine.add_request(prompt, params, adapter=names[index % len(names)] if names else None)
    while engine.has_unfinished_requests():
        engine.step()
    return (engine.stats().num_generated_tokens - before) / (time.perf_counter() - start)


def run_vllm(python: Path, env: dict[str, str], folder: Path, workload_file: Path, lora: bool, k: int) -> float:
    """Output tok/s of one vLLM-CPU process on the workload (its last stdout line is the worker's JSON)."""
    command = [str(python), str(WORKER), "--workload", str(workload_file), "--model", str(folder)]
    command += ["--lora", "--num-adapters", str(k)] if lora else []
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM-CPU failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])["tok_s"]


def engine_cases(folder: Path, vllm: VllmEnv, workload: dict, scratch: Path) -> dict[str, Callable[[], float]]:
    """One measurement of each engine and case through its Python API, by name."""
    vllm_env = vllm.process_env(num_cores=len(os.sched_getaffinity(0)))
    workload_file = scratch / "vllm-cpu-workload.json"  # what the vLLM processes read
    workload_file.write_text(json.dumps(workload))
    cases = {
        "vllm_compiled_base": lambda: run_vllm(vllm.python, vllm_env, folder, workload_file, lora=False, k=0),
        "vllm_lora_base": lambda: run_vllm(vllm.python, vllm_env, folder, workload_file, lora=True, k=0),
        "loraplex_base": lambda: run_loraplex(folder, workload, 0),
    }
    for k in ADAPTER_COUNTS:
        cases[f"vllm_lora_k{k}"] = lambda k=k: run_vllm(vllm.python, vllm_env, folder, workload_file, lora=True, k=k)
        cases[f"loraplex_k{k}"] = lambda k=k: run_loraplex(folder, workload, k)
    return cases


def engine_round(
    cases: dict[str, Callable[[], float]], rates: dict[str, list[float]], round_: int, repeats: int
) -> None:
    for name, run in cases.items():
        rates.setdefault(name, []).append(run())
        logger.info("round %d/%d, %s: %.1f tok/s", round_ + 1, repeats, name, rates[name][-1])


def engine_ratios(median: dict[str, float]) -> dict:
    result = {"base_vs_vllm_compiled": round(median["loraplex_base"] / median["vllm_compiled_base"], 3)}
    for k in ADAPTER_COUNTS:
        result[f"k{k}_vs_vllm_lora"] = round(median[f"loraplex_k{k}"] / median[f"vllm_lora_k{k}"], 3)
    return result


def http_servers(
    args: argparse.Namespace, folder: Path, vllm: VllmEnv | None, vocab_size: int, adapters: list[Path], scratch: Path
) -> dict[str, Callable[[], dict[str, float]]]:
    """Per server, one run of every case over HTTP (a fresh server each time): its tok/s by case."""
    counts = (0, *ADAPTER_COUNTS)
    # Prompts of their own per case: a server runs every case, and must not find one's prompts cached by another.
    prompts = {
        k: make_workload(vocab_size, args.num_requests, args.max_tokens, [], args.seed + 1 + k)["prompts"]
        for k in counts
    }
    named = {f"a{i}": path for i, path in enumerate(adapters)}

    def cases(ks: tuple[int, ...]) -> Callable:
        return lambda target: {_case(k): run_case(target, prompts[k], k, args.max_tokens) for k in ks}

    servers: dict[str, Callable[[], dict[str, float]]] = {}
    if vllm is not None:
        vllm_env = vllm.process_env(num_cores=len(os.sched_getaffinity(0)))
        servers["vllm_server"] = lambda: on_vllm(vllm.python, vllm_env, folder, scratch, None, cases((0,)), args.dtype)
        servers["vllm_lora_server"] = lambda: on_vllm(
            vllm.python, vllm_env, folder, scratch, named, cases(counts), args.dtype
        )
    for engine in args.http_engines:
        servers[f"loraplex_{engine}"] = lambda engine=engine: on_loraplex(
            folder, engine, scratch, named, cases(counts), args.dtype
        )
    return servers


def http_round(
    servers: dict[str, Callable[[], dict[str, float]]], rates: dict[str, list[float]], round_: int, repeats: int
) -> None:
    order = list(servers) if round_ % 2 == 0 else list(reversed(servers))  # the servers' order reverses each round
    for server in order:
        for case, rate in servers[server]().items():
            rates.setdefault(f"http_{server}_{case}", []).append(rate)
            logger.info("round %d/%d, http %s %s: %.1f tok/s", round_ + 1, repeats, server, case, rate)


def http_ratios(args: argparse.Namespace, median: dict[str, float], with_vllm: bool) -> dict:
    first = args.http_engines[0]
    result: dict = {"http_engine": first}
    counts = (0, *ADAPTER_COUNTS)
    if with_vllm:
        result["http_base_vs_vllm_server"] = round(
            median[f"http_loraplex_{first}_base"] / median["http_vllm_server_base"], 3
        )
        for k in ADAPTER_COUNTS:
            ours, theirs = median[f"http_loraplex_{first}_k{k}"], median[f"http_vllm_lora_server_k{k}"]
            result[f"http_k{k}_vs_vllm_server"] = round(ours / theirs, 3)
    return result | _process_vs_thread(args, median, counts)


def http_vs_engine(args: argparse.Namespace, median: dict[str, float]) -> dict:
    """What each engine keeps of its engine-level rate through its HTTP server (both levels in the same rounds)."""
    first = args.http_engines[0]
    result = {"loraplex_http_vs_engine_base": round(median[f"http_loraplex_{first}_base"] / median["loraplex_base"], 3)}
    result["vllm_http_vs_engine_base"] = round(median["http_vllm_server_base"] / median["vllm_compiled_base"], 3)
    for k in ADAPTER_COUNTS:
        ours = median[f"http_loraplex_{first}_k{k}"] / median[f"loraplex_k{k}"]
        theirs = median[f"http_vllm_lora_server_k{k}"] / median[f"vllm_lora_k{k}"]
        result[f"loraplex_http_vs_engine_k{k}"] = round(ours, 3)
        result[f"vllm_http_vs_engine_k{k}"] = round(theirs, 3)
    return result


def _process_vs_thread(args: argparse.Namespace, median: dict[str, float], counts: tuple[int, ...]) -> dict:
    if not {"process", "thread"} <= set(args.http_engines):
        return {}
    return {
        f"http_{_case(k)}_process_vs_thread": round(
            median[f"http_loraplex_process_{_case(k)}"] / median[f"http_loraplex_thread_{_case(k)}"], 3
        )
        for k in counts
    }


def _case(num_adapters: int) -> str:
    return f"k{num_adapters}" if num_adapters else "base"


def _figures(median: dict[str, float], rates: dict[str, list[float]]) -> dict:
    result: dict = {f"{name}_tok_s": round(value, 1) for name, value in median.items()}
    result |= {f"{name}_tok_s_rounds": [round(v, 1) for v in values] for name, values in rates.items()}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", choices=LEVELS, default="both", help="engine API, HTTP servers, or both")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every case, in turn")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--http-engines",
        type=lambda text: tuple(text.split(",")),
        default=DEFAULT_HTTP_ENGINES,
        help=f"LORAPLEX_ENGINE settings served over HTTP, comma-separated; the first is compared with vLLM "
        f"(default {','.join(DEFAULT_HTTP_ENGINES)}; scripts/benchmarks/gateway/bench_ray.py compares ray with local)",
    )
    parser.add_argument("--skip-vllm", action="store_true", help="HTTP level: loraplex's servers only, no ratios")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both engines' dtype")
    parser.add_argument("--without-amx", action="store_true", help="both engines as on a CPU without AMX tiles")
    args = parser.parse_args(argv)
    if args.without_amx and any(os.environ.get(name) != value for name, value in WITHOUT_AMX.items()):
        if "avx512_bf16" not in cpu_flags().split():
            parser.error("--without-amx needs a CPU with AVX512-BF16 (avx512_bf16 in /proc/cpuinfo)")
        os.environ.update(WITHOUT_AMX)  # read by oneDNN and the native build as they start: run afresh
        os.execv(sys.executable, [sys.executable, "-m", __spec__.name, *(sys.argv[1:] if argv is None else argv)])
    if args.repeats < 1 or args.num_requests < 1 or args.max_tokens < 1:
        parser.error("--repeats, --num-requests and --max-tokens must be at least 1")
    if not args.http_engines or not set(args.http_engines) <= set(ENGINE_KINDS):
        parser.error(f"--http-engines takes any of {', '.join(ENGINE_KINDS)}, comma-separated")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    settings = Settings.from_env()
    folder = resolve_model(settings.model, settings.home)
    vllm = None if args.skip_vllm and args.level == "http" else ensure_vllm_env(settings.home)
    model = ModelConfig.from_folder(folder)
    scratch = settings.home / "bench"
    adapter_root = scratch / f"adapters-r{RANK}-all-linear"
    adapters = [
        write_synthetic_adapter(adapter_root / f"a{i}", model, RANK, seed=i, targets=PROJECTIONS)
        for i in range(max(ADAPTER_COUNTS))
    ]
    engine = args.level in ("engine", "both")
    http = args.level in ("http", "both")
    cases = {}
    if engine:
        assert vllm is not None
        workload = make_workload(model.vocab_size, args.num_requests, args.max_tokens, adapters, args.seed, args.dtype)
        cases = engine_cases(folder, vllm, workload, scratch)
    with_vllm = http and not args.skip_vllm
    servers = {}
    if http:
        servers = http_servers(args, folder, vllm if with_vllm else None, model.vocab_size, adapters, scratch)
    # Both levels in every round, so a drift of the machine's speed over the run touches both alike.
    rates: dict[str, list[float]] = {}
    for round_ in range(args.repeats):
        engine_round(cases, rates, round_, args.repeats)
        http_round(servers, rates, round_, args.repeats)
    median = {name: statistics.median(values) for name, values in rates.items()}
    result = _figures(median, rates) | {"without_amx": args.without_amx}
    if engine:
        result |= engine_ratios(median)
    if http:
        result |= http_ratios(args, median, with_vllm)
    if engine and with_vllm:
        result |= http_vs_engine(args, median)
    out = sys.stdout
    if args.json:
        out.write(json.dumps(result) + "\n")
    else:
        out.writelines(f"{key:>40}: {value}\n" for key, value in result.items())
    return 0


if __name__ == "__main__":
    sys.exit(main())
