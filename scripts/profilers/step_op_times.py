"""Wall time of each op of the model's forward pass on bench_vllm_cpu.py's workload, without a profiler.

Runs the workload of ``bench_vllm_cpu.py`` (64 requests, prompts of 64 to 128 random tokens, 64 output
tokens, greedy, ``ignore_eos``) on the base model after a warm-up, with a clock around every call the model
makes to its ops (``engine.modeling.model``'s ``add_rms_norm``, ``linear``, ``linear_silu_mul``, ``rope_kv_write``,
``paged_attention``, ``silu_mul``; ``linear`` split by its output width, so the LM head and each projection
are apart) and around the step's batch building and sampling. Steps that compute prompt tokens ("prefill")
are counted apart from steps of decode rows only ("decode"); each kind reports its steps, their wall time,
each op's total ms, and the rest (Python, the scheduler, the update). torch.profiler (profile_engine.py)
adds its own cost to every operator; this adds one clock read per call.

    python -m scripts.profilers.step_op_times --dtype bfloat16 --json    # last line: one JSON object
"""

import argparse
import functools
import json
import logging
import sys
import time
from collections import defaultdict

import engine.modeling.model as model_module
import engine.step.step_runner as step_runner_module
from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, SamplingParams
from engine.config import ModelConfig
from scripts.benchmarks.peers.bench_vllm_cpu import make_workload

MODEL_OPS = ("add_rms_norm", "linear", "linear_silu_mul", "rope_kv_write", "paged_attention", "silu_mul")
STEP_OPS = ("build_step_batch", "build_sampling_batch", "draw")


class OpClock:
    """Accumulates the wall time of wrapped calls under (step kind, op name)."""

    def __init__(self) -> None:
        self.kind = "warm-up"
        self.ms: dict[tuple[str, str], float] = defaultdict(float)

    def wrap(self, module: object, name: str) -> None:
        """Replace ``module.name`` with a timed call of it."""
        fn = getattr(module, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            key = f"linear_{args[1].out_features}" if name == "linear" else name
            self.ms[(self.kind, key)] += (time.perf_counter() - start) * 1e3
            return out

        setattr(module, name, timed)


def run(args: argparse.Namespace) -> dict:
    settings = Settings.from_env()
    folder = resolve_model(settings.model, settings.home)
    config = ModelConfig.from_folder(folder)
    workload = make_workload(config.vocab_size, args.num_requests, args.max_tokens, [], seed=0)
    clock = OpClock()
    for name in MODEL_OPS:
        if hasattr(model_module, name):  # an older checkout may lack one (linear_silu_mul)
            clock.wrap(model_module, name)
    for name in STEP_OPS:
        clock.wrap(step_runner_module, name)
    engine = Engine(EngineConfig(model=str(folder), max_num_seqs=64, dtype=args.dtype, quantization=args.quantization))
    scheduler = engine._runner.scheduler
    schedule = scheduler.schedule

    def schedule_and_classify():
        out = schedule()
        rows = sum(item.num_new_tokens for item in out.scheduled)
        clock.kind = "prefill" if rows > len(out.scheduled) else "decode"
        return out

    scheduler.schedule = schedule_and_classify
    engine.generate(workload["prompts"][:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    clock.ms.clear()
    params = SamplingParams(max_tokens=workload["max_tokens"], temperature=0.0, ignore_eos=True)
    for prompt in workload["prompts"]:
        engine.add_request(prompt, params)
    steps: dict[str, int] = defaultdict(int)
    wall: dict[str, float] = defaultdict(float)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        engine.step()
        wall[clock.kind] += (time.perf_counter() - step_start) * 1e3
        steps[clock.kind] += 1
    total_s = time.perf_counter() - start
    result = {
        "precision": engine.stats().precision_reason,
        "tok_s": round(len(workload["prompts"]) * workload["max_tokens"] / total_s, 1),
    }
    for kind in ("prefill", "decode"):
        ops = {op: round(ms, 1) for (k, op), ms in sorted(clock.ms.items(), key=lambda i: -i[1]) if k == kind}
        result[kind] = {
            "steps": steps[kind],
            "wall_ms": round(wall[kind], 1),
            "ops_ms": ops,
            "rest_ms": round(wall[kind] - sum(ops.values()), 1),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--quantization", default=None, choices=("int8",))
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    result = run(args)
    sys.stdout.write(json.dumps(result) + "\n" if args.json else json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
