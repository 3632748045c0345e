"""Multi-adapter throughput (S-LoRA's workload shape) against the base model and HF PEFT, in one run.

N requests (default 64) with random prompts of 32 to 128 tokens and outputs of 16 to 64 tokens from a
fixed seed, greedy, ignore_eos; each request names one of n adapters drawn by a power law (alpha = 1),
n in {1, 16, 128, 512}, ranks cycling over {8, 16, 32}, targets q/k/v/o as in S-LoRA. The adapters are
synthetic PEFT folders (random bf16 weights) written once into --adapter-dir. Every configuration runs
on a fresh engine (no prefix hits across runs), after a warm-up, with at most --max-batch sequences.
The PEFT baseline runs the 16-adapter requests through ``generate(adapter_names=...)`` in static
left-padded batches of --max-batch.

The host is shared and its speed drifts by 20 % within minutes, so one run per configuration makes the
ratios noise: the configurations (PEFT included) run --repeats times in turn, round after round, and
each figure is its configuration's median.

    python -m scripts.benchmarks.engine.bench_lora --json      # last line: one JSON object

With PEFT, ``base_vs_peft_16`` divides the base model's rate by PEFT's: the bound on
``speedup_vs_peft_16`` that making the adapters' work free would reach.
"""

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, SamplingParams
from engine.adapters.lora_config import module_key, projection_shapes
from engine.config import ModelConfig

logger = logging.getLogger("bench_lora")

RANKS = (8, 16, 32)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTER_COUNTS = (1, 16, 128, 512)
WEIGHT_STD = 0.02


def write_synthetic_adapter(
    folder: Path, model: ModelConfig, rank: int, seed: int, targets: tuple[str, ...] = TARGETS
) -> Path:
    """A PEFT LoRA folder with random weights for ``model`` on ``targets`` (what PEFT's save_pretrained writes)."""
    if (folder / "adapter_model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(model)
    tensors = {}
    for layer in range(model.num_layers):
        for module in targets:
            in_dim, out_dim = shapes[module]
            prefix = f"base_model.model.{module_key(layer, module)}"
            a = torch.randn(rank, in_dim, generator=generator) * WEIGHT_STD  # [rank, in]
            b = torch.randn(out_dim, rank, generator=generator) * WEIGHT_STD  # [out, rank]
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
        "bias": "none",
        "lora_dropout": 0.0,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def make_requests(num: int, vocab: int, num_adapters: int, seed: int) -> list[tuple[list[int], int, int]]:
    """(prompt ids, output length, adapter index) per request; adapters by a power law of exponent 1."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(num_adapters)]
    return [
        (
            [rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 128))],
            rng.randint(16, 64),
            rng.choices(range(num_adapters), weights)[0],
        )
        for _ in range(num)
    ]


def run_engine(
    folder: Path, adapters: list[Path] | None, requests: list, max_batch: int
) -> tuple[float, dict[str, int], float]:
    """Output tokens/s, peak pages by owner kind, and seconds spent registering the adapters."""
    engine = Engine(EngineConfig(model=str(folder), max_num_seqs=max_batch))
    start = time.perf_counter()
    names = []
    for index, path in enumerate(adapters or []):
        names.append(f"a{index}")
        engine.add_adapter(names[-1], path)
    register_s = time.perf_counter() - start
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate([[7] * 40, [9] * 20], warm, adapters=[names[0] if names else None, None])
    peak: dict[str, int] = {}
    start = time.perf_counter()
    for prompt, num_out, adapter in requests:
        params = SamplingParams(max_tokens=num_out, temperature=0.0, ignore_eos=True)
        engine.add_request(prompt, params, adapter=names[adapter] if names else None)
    while engine.has_unfinished_requests():
        engine.step()
        for kind, count in engine.pool.stats().pages_by_owner.items():
            peak[kind] = max(peak.get(kind, 0), count)
    elapsed = time.perf_counter() - start
    return sum(r[1] for r in requests) / elapsed, peak, register_s


def run_peft(folder: Path, adapters: list[Path], requests: list, max_batch: int) -> float:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapters[0], adapter_name="a0")
    for index, path in enumerate(adapters[1:], start=1):
        model.load_adapter(path, adapter_name=f"a{index}")
    model.eval()
    start = time.perf_counter()
    for first in range(0, len(requests), max_batch):
        batch = requests[first : first + max_batch]
        width = max(len(p) for p, _, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _, _ in batch])  # [batch, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _, _ in batch])  # [batch, width]
        max_new = max(n for _, n, _ in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
                adapter_names=[f"a{a}" for _, _, a in batch],
            )
    return sum(r[1] for r in requests) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the data folder's default model)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adapter-dir", type=Path, default=None, help="where synthetic adapters are kept")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every configuration; medians reported")
    parser.add_argument("--skip-peft", action="store_true")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    settings = Settings.from_env()
    folder = Path(args.model or resolve_model(settings.model, settings.home))
    model = ModelConfig.from_folder(folder)
    adapter_dir = args.adapter_dir or Path(tempfile.gettempdir()) / f"loraplex-bench-adapters-{model.hidden_size}"
    paths = [
        write_synthetic_adapter(adapter_dir / f"a{i}", model, RANKS[i % len(RANKS)], seed=i)
        for i in range(max(ADAPTER_COUNTS))
    ]
    logger.info("%d synthetic adapters in %s", len(paths), adapter_dir)

    result: dict[str, object] = {"num_requests": args.num_requests, "max_batch": args.max_batch}
    result["repeats"] = args.repeats
    base_requests = make_requests(args.num_requests, model.vocab_size, 1, args.seed)
    configs: dict[str, tuple[list[Path] | None, list]] = {"base": (None, base_requests)}
    for count in ADAPTER_COUNTS:
        configs[str(count)] = (paths[:count], make_requests(args.num_requests, model.vocab_size, count, args.seed))
    tok_s: dict[str, list[float]] = {name: [] for name in configs}
    peaks: dict[str, dict[str, int]] = {name: {} for name in configs}  # pages by owner kind, over every round
    peft_tok_s: list[float] = []
    for round_index in range(args.repeats):
        for name, (adapters, requests) in configs.items():
            rate, peak, register_s = run_engine(folder, adapters, requests, args.max_batch)
            tok_s[name].append(rate)
            for kind, count in peak.items():
                peaks[name][kind] = max(peaks[name].get(kind, 0), count)
            if adapters is not None:
                result[f"register_s_{name}"] = round(register_s, 2)
            logger.info(
                "round %d, %s: %.1f tok/s (registration %.1f s), peak pages %s",
                round_index + 1,
                name,
                rate,
                register_s,
                peak,
            )
        if not args.skip_peft:
            peft_tok_s.append(run_peft(folder, paths[:16], configs["16"][1], args.max_batch))
            logger.info("round %d, PEFT with 16 adapters: %.1f tok/s", round_index + 1, peft_tok_s[-1])
    median = {name: statistics.median(rates) for name, rates in tok_s.items()}
    result.update({f"peak_pages_{name}": peak for name, peak in peaks.items()})
    result["base_tok_s"] = round(median["base"], 1)
    result["tok_s_by_adapters"] = {str(count): round(median[str(count)], 1) for count in ADAPTER_COUNTS}
    result["tok_s_runs"] = {name: [round(rate, 1) for rate in rates] for name, rates in tok_s.items()}
    result["ratio_128_vs_1"] = round(median["128"] / median["1"], 3)
    result["ratio_1_vs_base"] = round(median["1"] / median["base"], 3)
    if peft_tok_s:
        result["peft_tok_s"] = round(statistics.median(peft_tok_s), 1)
        result["peft_tok_s_runs"] = [round(rate, 1) for rate in peft_tok_s]
        result["speedup_vs_peft_16"] = round(median["16"] / statistics.median(peft_tok_s), 2)
        # The base model alone against PEFT: what speedup_vs_peft_16 would be if the adapters cost nothing.
        result["base_vs_peft_16"] = round(median["base"] / statistics.median(peft_tok_s), 2)
    out = sys.stdout
    if args.json:
        out.write(json.dumps(result) + "\n")
    else:
        out.writelines(f"{key:>22}: {value}\n" for key, value in result.items())
    return 0


if __name__ == "__main__":
    sys.exit(main())
