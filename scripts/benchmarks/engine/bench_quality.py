"""Quality of the bf16 and int8 modes against float32, on a fixed text and question set shipped with the tests.

For each mode (bf16; int8 weights with the bf16 model dtype) against a float32 engine, with and without an
adapter (a seeded random rank-8 PEFT LoRA on every projection, small enough to keep the text readable):

- perplexity of the text (tests/data/quality/text.txt), each mode's over float32's: the ratio;
- top-1 agreement: float32 continues ``--prompts`` prompts (windows of the text) greedily for ``--tokens``
  tokens; each mode then scores prompt + continuation, and at every continuation position its most
  likely token is compared with float32's (teacher-forced, so one early difference does not carry on);
- accuracy on a small multiple-choice set (tests/data/quality/questions.json), each choice scored by the
  sum of its tokens' log-probabilities after the question (order of the choices plays no part).

    python -m scripts.benchmarks.engine.bench_quality --json     # last line: one JSON object

``--bf16-gemm`` (default: ``LORAPLEX_BF16_GEMM``, else auto) picks the native GEMM of the bf16 and int8 modes.
"""

import argparse
import json
import logging
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, SamplingParams
from scripts import REPO_ROOT

logger = logging.getLogger("bench_quality")

DATA = REPO_ROOT / "tests" / "data" / "quality"
PROMPT_TOKENS = 24  # each agreement prompt: a window of the text this long
ADAPTER_NAME = "quality"
ADAPTER_RANK = 8
ADAPTER_B_STD = 0.02  # PEFT starts B at zero; this moves the outputs without wrecking the text
BOUNDS = {"bf16_ppl_ratio": 1.01, "int8_ppl_ratio": 1.03}
MODES = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
}


@dataclass(frozen=True, slots=True)
class ModeScores:
    perplexity: float
    top1: list[list[int]]  # per prompt, the mode's likeliest token at each continuation position
    correct: list[bool]  # per question


def load_questions() -> list[dict]:
    return json.loads((DATA / "questions.json").read_text())


def agreement_prompts(text_ids: list[int], num_prompts: int) -> list[list[int]]:
    """``num_prompts`` windows of ``PROMPT_TOKENS`` tokens spread evenly over the text."""
    last_start = len(text_ids) - PROMPT_TOKENS
    return [text_ids[i * last_start // max(num_prompts - 1, 1) :][:PROMPT_TOKENS] for i in range(num_prompts)]


def score(engine: Engine, sequences: list[list[int]], adapter: str | None, num_top: int = 0) -> list[list]:
    """Each sequence's prompt logprobs (the first position has none)."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=num_top)
    outputs = engine.generate(sequences, params, [adapter] * len(sequences))
    return [output.prompt_logprobs[1:] for output in outputs]


def continue_greedily(
    engine: Engine, prompts: list[list[int]], num_tokens: int, adapter: str | None
) -> list[list[int]]:
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    return [output.token_ids for output in engine.generate(prompts, params, [adapter] * len(prompts))]


def measure(
    engine: Engine,
    text_ids: list[int],
    prompts: list[list[int]],
    continuations: list[list[int]],
    questions: list[dict],
    adapter: str | None,
) -> ModeScores:
    [text_logprobs] = score(engine, [text_ids], adapter)
    perplexity = math.exp(-sum(p.logprob for p in text_logprobs) / len(text_logprobs))
    scored = score(engine, [p + c for p, c in zip(prompts, continuations, strict=True)], adapter, num_top=1)
    top1 = [
        [p.top[0][0] for p in positions[len(prompt) - 1 :]] for prompt, positions in zip(prompts, scored, strict=True)
    ]
    tokenizer = engine.tokenizer
    questions_ids = [tokenizer.encode(item["question"]) for item in questions]
    sequences = [
        question + tokenizer.encode(choice, add_special_tokens=False)
        for question, item in zip(questions_ids, questions, strict=True)
        for choice in item["choices"]
    ]
    logprobs = iter(score(engine, sequences, adapter))  # every choice of every question in one batch
    correct = []
    for question, item in zip(questions_ids, questions, strict=True):
        totals = [sum(p.logprob for p in next(logprobs)[len(question) - 1 :]) for _ in item["choices"]]
        correct.append(max(range(len(totals)), key=totals.__getitem__) == item["answer"])
    return ModeScores(perplexity, top1, correct)


def make_adapter(base: Path, out: Path, seed: int = 0) -> Path:
    """A seeded random rank-8 PEFT LoRA on every projection of ``base``, saved into ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=ADAPTER_RANK, lora_alpha=16, target_modules=targets))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, ADAPTER_B_STD)
    peft_model.save_pretrained(out)
    return out


def run(
    folder: str, adapter_folder: Path, num_prompts: int, num_tokens: int, modes: dict = MODES, bf16_gemm: str = "auto"
) -> dict:
    """Every mode's scores against float32's, without and with the adapter: one flat dict of figures."""
    questions = load_questions()
    text = (DATA / "text.txt").read_text()
    results: dict = {}
    reference: dict[str | None, ModeScores] = {}
    continuations: dict[str | None, list[list[int]]] = {}
    for mode, overrides in modes.items():
        engine = Engine(EngineConfig(model=folder, pool_bytes=256 * 1024**2, bf16_gemm=bf16_gemm, **overrides))
        engine.add_adapter(ADAPTER_NAME, adapter_folder)
        results[f"{mode}_precision"] = engine.precision.reason
        text_ids = engine.tokenizer.encode(text)
        prompts = agreement_prompts(text_ids, num_prompts)
        for adapter in (None, ADAPTER_NAME):
            suffix = "_adapter" if adapter else ""
            if mode == "fp32":
                continuations[adapter] = continue_greedily(engine, prompts, num_tokens, adapter)
            scores = measure(engine, text_ids, prompts, continuations[adapter], questions, adapter)
            results[f"{mode}_perplexity{suffix}"] = round(scores.perplexity, 4)
            results[f"{mode}_mc_accuracy{suffix}"] = round(sum(scores.correct) / len(scores.correct), 3)
            if mode == "fp32":
                reference[adapter] = scores
                continue
            ref = reference[adapter]
            results[f"{mode}_ppl_ratio{suffix}"] = round(scores.perplexity / ref.perplexity, 5)
            pairs = [
                (a, b)
                for mine, theirs in zip(scores.top1, continuations[adapter], strict=True)
                for a, b in zip(mine, theirs, strict=True)
            ]
            results[f"{mode}_top1_agreement{suffix}"] = round(sum(a == b for a, b in pairs) / len(pairs), 4)
            same_pick = sum(a == b for a, b in zip(scores.correct, ref.correct, strict=True))
            results[f"{mode}_mc_same_as_fp32{suffix}"] = round(same_pick / len(questions), 3)
            logger.info(
                "%s%s: ppl %.4f (fp32 %.4f), top-1 agreement %.4f",
                mode,
                suffix,
                scores.perplexity,
                ref.perplexity,
                results[f"{mode}_top1_agreement{suffix}"],
            )
        del engine
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the data folder's default model)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--adapter", default=None, help="a PEFT LoRA folder (default: a seeded random one)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument(
        "--bf16-gemm",
        default=None,
        choices=("auto", "widen", "dot"),
        help="the native GEMM of bf16 and int8 weights (default: LORAPLEX_BF16_GEMM, else auto)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    settings = Settings.from_env()
    folder = args.model or str(resolve_model(settings.model, settings.home))
    with tempfile.TemporaryDirectory() as scratch:
        adapter = Path(args.adapter) if args.adapter else make_adapter(Path(folder), Path(scratch) / "adapter")
        results = run(folder, adapter, args.prompts, args.tokens, bf16_gemm=args.bf16_gemm or settings.bf16_gemm)
    failed = [key for key, bound in BOUNDS.items() for k in (key, key + "_adapter") if results[k] > bound]
    results["bounds_hold"] = not failed
    if args.json:
        sys.stdout.write(json.dumps(results) + "\n")
    else:
        sys.stdout.writelines(f"{key:>32}: {value}\n" for key, value in results.items())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
