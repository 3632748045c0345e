"""The GPU checks of a CUDA machine with no network, in one command: ``prepare`` here, ``run`` there.

``prepare`` (scripts/tools/gpu_prepare.py) runs on a development machine in the checkout that is copied to
the CUDA machine: the wheels of what the checks import and the device image lacks into ``.gpu/wheels``, the
default model's tokenizer files into ``.gpu/tokenizer``; it prints the folder to carry and the command.

``run`` runs on the CUDA machine from the repository's root. It installs the carried wheels into a folder
of its own (``pip --no-index --no-deps --target``), then runs each step with a time limit, a failing or
stopped step never stopping the next, and writes each step's output to the output folder ($OUT):

- ``nvidia-smi``: the GPU and its driver (nvidia-smi.txt);
- ``setup``: the wheels installed, then the Python packages' versions beside the lock's (setup.log);
- ``op-checks``: each op of ``loraplex_kernels.op_checks`` through the Triton kernels on CUDA in fp32, fp16
  and bf16 against its torch implementation on the CPU, as ``loraplex doctor`` runs them (op_checks.log);
- ``bench``: ``scripts.benchmarks.engine.bench_gpu --json`` (bench_gpu.json, its log in bench_gpu.log). Without
  transformers' anchor unless --bench-hf: that part alone ran over four minutes on an H200 (PEFT's mixed
  batch at 135 tokens/s), more than the other steps leave it;
- ``tests``: the engine's tests of the CUDA path, one pytest run per file with ``-x -q`` (pytest.log);
- ``kernels``: ``scripts.benchmarks.kernels.bench_triton_kernels --sweep --json``: the decode step's Triton kernels
  alone at the bench's shape, their bandwidth, and every num_warps × num_stages tried (kernels.json, its log
  in kernels.log);
- ``phases``: ``scripts.profilers.host_step_phases --cuda`` on the bench's model, without and with 16 adapters:
  the host's time in each phase of a decode step at 256 rows (phases.log). Last, so a slow bench cuts it first.

Every Python step runs with TRITON_INTERPRET=0 (tests/conftest.py only sets it when it is unset), so the
kernels compile for the GPU. summary.json holds each step's exit status and seconds, the op checks' errors
and the bench's and the kernels' figures; the same table ends the output. Every step ends by --deadline-s (under nine
minutes), inside a ten-minute command: a step that would start later is not started.

    python -m scripts.tools.gpu_checks prepare                 # here; prints the carry list and the command
    python3 -m scripts.tools.gpu_checks run                    # on the CUDA machine; writes to $OUT
    python -m scripts.tools.gpu_checks run --dry-run           # the commands, without running them
    python -m scripts.tools.gpu_checks run --cpu --out /tmp/o  # the same steps on a CPU, under the interpreter
"""

import argparse
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path

from scripts.tools.gpu_device_checks import CUDA_DTYPES, check_ops, write_versions
from scripts.tools.gpu_prepare import GPU_FOLDER, ROOT, TOKENIZER, WHEELS, prepare
from scripts.tools.timed_steps import Command, Step, StepResult, run_step

logger = logging.getLogger("gpu_checks")


# The steps' time limits, seconds; together they exceed the deadline, which cuts the last step short instead.
NVIDIA_SMI_S = 20
SETUP_S = 60
OP_CHECKS_S = 100
BENCH_S = 240  # bench_gpu without transformers' anchor: writing the 1.1B model and 64 adapters, seven workloads
# With transformers' anchor (over four minutes of it on an H200): the whole command, run alone with
# `--only bench --bench-hf --deadline-s 580`.
BENCH_HF_S = 570
KERNELS_S = 90  # bench_triton_kernels --sweep: 7 kernels, 12 launch options each
TESTS_S = 150
PHASES_S = 60  # host_step_phases on bench_gpu's model, written by then: the host's share of a step, phase by phase
DEADLINE_S = 510  # every step ends by then, well inside DEVICE_TIMEOUT_S

CPU_DTYPES = ("float32", "float16")  # the interpreter's tl.dot multiplies bf16 bit patterns
TEST_FILES = (
    "tests/engine/test_triton_engine.py",
    "tests/engine/test_decode_graphs.py",
    "tests/engine/test_graph_lora.py",
    "tests/engine/test_cuda_paths_sizing.py",
    "tests/engine/test_cuda_paths_staging.py",
    "tests/engine/test_cuda_paths_upload.py",
    "tests/engine/test_kernel_backend.py",
)
# Tests of what a CPU-only run sees, which fail by design on a CUDA machine with TRITON_INTERPRET=0:
# (file, test, why).
DESELECTED_TESTS = (
    (
        "tests/engine/test_triton_engine.py",
        "test_triton_resolves_on_cpu_under_the_interpreter_and_auto_is_triton_on_cuda",
        "asserts every kernel was defined for the interpreter",
    ),
    (
        "tests/engine/test_triton_engine.py",
        "test_a_kernel_defined_for_the_compiler_is_named",
        "swaps one of the interpreter's kernels for a compiled one",
    ),
    (
        "tests/engine/test_kernel_backend.py",
        "test_auto_runs_the_native_kernels_where_they_build",
        "device='auto' is CUDA there, where kernels='auto' is Triton",
    ),
    (
        "tests/engine/test_kernel_backend.py",
        "test_native_without_a_compiler_is_a_config_error",
        "on CUDA, kernels='native' is refused for the device before the compiler is asked",
    ),
    (
        "tests/engine/test_kernel_backend.py",
        "test_auto_without_a_compiler_falls_back_to_torch_and_serves",
        "on CUDA, kernels='auto' is Triton, not the torch fallback",
    ),
)
DESELECTED = {f"{path}::{test}": why for path, test, why in DESELECTED_TESTS}
JSON_STEPS = {"bench": "bench_gpu.json", "kernels": "kernels.json"}  # steps whose last stdout line is their figures


# run -----------------------------------------------------------------------------------------------------


def plan_steps(work: Path, cpu: bool, bench_hf: bool) -> list[Step]:
    """The checks in the order they run. ``cpu``: the same steps on a CPU, for checking this script."""
    python = sys.executable
    ops = (
        python, "-m", "scripts.tools.gpu_checks", "ops", "--device", "cpu" if cpu else "cuda",
        "--dtypes", ",".join(CPU_DTYPES if cpu else CUDA_DTYPES), "--json", str(work / "op_checks.json"),
    )  # fmt: skip
    bench = [python, "-m", "scripts.benchmarks.engine.bench_gpu", "--json", "--tokenizer-dir", str(ROOT / TOKENIZER)]
    bench += ["--model-dir", str(work / "bench_gpu")]
    bench += ["--quick"] if cpu else []
    bench += [] if bench_hf else ["--skip-hf"]
    kernels = [python, "-m", "scripts.benchmarks.kernels.bench_triton_kernels", "--sweep", "--json"]
    kernels += ["--quick"] if cpu else []
    phases = [python, "-m", "scripts.profilers.host_step_phases", "--json", "--steps", "30"]
    phases += ["--tokenizer-dir", str(ROOT / TOKENIZER), "--model-dir", str(work / "bench_gpu")]
    phases += [] if cpu else ["--cuda"]
    pytest = (python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider")
    install = (
        python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
        "--disable-pip-version-check", "--upgrade", "--target", str(work / "site"),
        *(str(wheel) for wheel in sorted((ROOT / WHEELS).glob("*.whl"))),
    )  # fmt: skip
    return [
        Step("nvidia-smi", (Command("nvidia-smi", ("nvidia-smi",)),), "nvidia-smi.txt", NVIDIA_SMI_S),
        Step(
            "setup",
            (
                Command("install", install),
                Command("versions", (python, "-m", "scripts.tools.gpu_checks", "versions")),
            ),
            "setup.log",
            SETUP_S,
        ),
        Step("op-checks", (Command("ops", ops),), "op_checks.log", OP_CHECKS_S),
        Step(
            "bench",
            (Command("bench_gpu", tuple(bench)),),
            "bench_gpu.log",
            BENCH_HF_S if bench_hf else BENCH_S,
            stdout=work / "bench_stdout.txt",
        ),
        Step(
            "tests",
            tuple(Command(Path(path).name, (*pytest, path, *deselect_args(path))) for path in TEST_FILES),
            "pytest.log",
            TESTS_S,
        ),
        Step(
            "kernels",
            (Command("bench_triton_kernels", tuple(kernels)),),
            "kernels.log",
            KERNELS_S,
            stdout=work / "kernels_stdout.txt",
        ),
        Step(
            "phases",
            (Command("base", (*phases, "--base")), Command("16 adapters", tuple(phases))),
            "phases.log",
            PHASES_S,
        ),
    ]


def deselect_args(path: str) -> list[str]:
    """pytest's options that leave out ``path``'s tests of DESELECTED_TESTS."""
    return [arg for file, test, _ in DESELECTED_TESTS if file == path for arg in ("--deselect", f"{file}::{test}")]


def step_env(work: Path, cpu: bool) -> dict[str, str]:
    """The steps' environment: the repository and the carried packages importable, the interpreter off on CUDA."""
    env = dict(os.environ)
    paths = [str(ROOT), str(work / "site"), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path for path in paths if path))
    env["TRITON_INTERPRET"] = "1" if cpu else "0"
    env["PYTHONUNBUFFERED"] = "1"
    env["LORAPLEX_HOME"] = str(work / "home")  # nothing written under the user's data folder
    return env


def preflight() -> list[str]:
    """What ``prepare`` should have left in the checkout, and is missing."""
    missing = []
    if not list((ROOT / WHEELS).glob("*.whl")):
        missing.append(f"no wheels in {WHEELS}")
    if not (ROOT / TOKENIZER / "config.json").is_file():
        missing.append(f"no config.json in {TOKENIZER}")
    advice = f"run `python -m scripts.tools.gpu_checks prepare` and carry {GPU_FOLDER}"
    return [f"{problem}: {advice}" for problem in missing]


def collect_json(step: Step, out: Path, name: str) -> dict | None:
    """A benchmark step's last stdout line, kept as ``name`` in ``out``; any other stdout lines go to its log."""
    lines = step.stdout.read_text().splitlines() if step.stdout and step.stdout.is_file() else []
    lines = [line for line in lines if line.strip()]
    figures = None
    if lines:
        try:
            figures = json.loads(lines[-1])
            lines.pop()
        except json.JSONDecodeError:
            figures = None
    if lines:
        with (out / step.log).open("a") as log:
            log.write("stdout:\n" + "\n".join(lines) + "\n")
    if figures is not None:
        (out / name).write_text(json.dumps(figures) + "\n")
    return figures


def run(args: argparse.Namespace) -> int:
    work = args.work
    steps = plan_steps(work, args.cpu, args.bench_hf)
    if args.only:
        names = {step.name for step in steps}
        unknown = set(args.only) - names
        if unknown:
            logger.error("no step named %s; the steps: %s", ", ".join(sorted(unknown)), ", ".join(sorted(names)))
            return 2
        steps = [step for step in steps if step.name in args.only]
    env = step_env(work, args.cpu)
    problems = preflight()
    if args.dry_run:
        write_plan(steps, env, args.out, problems)
        return 0
    if args.out is None:
        logger.error("no output folder: set OUT or pass --out")
        return 2
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    for problem in problems:
        logger.warning("%s", problem)
    deadline = time.monotonic() + args.deadline_s
    results: list[StepResult] = []
    summary: dict[str, object] = {"problems": problems, "deselected": DESELECTED}
    for step in steps:
        logger.info("%s: started (at most %d s)", step.name, step.budget_s)
        result = run_step(step, env, out, deadline, cwd=ROOT)
        if step.name == "op-checks":
            report = work / "op_checks.json"
            summary["op_checks"] = json.loads(report.read_text()) if report.is_file() else None
            report.unlink(missing_ok=True)  # a rerun must not show this run's results
        if step.name in JSON_STEPS:
            summary[step.name] = collect_json(step, out, JSON_STEPS[step.name])
            if summary[step.name] is None:
                result.note = "no JSON line on stdout"
        logger.info("%s: exit status %d after %.1f s", step.name, result.returncode, result.seconds)
        results.append(result)
    summary["steps"] = [
        {"step": r.name, "returncode": r.returncode, "seconds": r.seconds, "commands": r.commands, "note": r.note}
        for r in results
    ]
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_summary(results, steps)
    return 0 if all(result.returncode == 0 for result in results) else 1


def write_plan(steps: list[Step], env: dict[str, str], out: Path | None, problems: list[str]) -> None:
    """What ``run`` would do: the environment it sets, each step's limit, commands and output file."""
    write = sys.stdout.write
    for name in ("PYTHONPATH", "TRITON_INTERPRET", "PYTHONUNBUFFERED", "LORAPLEX_HOME"):
        write(f"{name}={env[name]}\n")
    write(f"output folder: {out or '(unset: set OUT or pass --out)'}\n")
    for step in steps:
        write(f"{step.name}: at most {step.budget_s} s, output {step.log}\n")
        for command in step.commands:
            write(f"  {shlex.join(command.argv)}{f' > {step.stdout}' if step.stdout else ''}\n")
    for problem in problems:
        write(f"missing: {problem}\n")


def write_summary(results: list[StepResult], steps: list[Step]) -> None:
    logs = {step.name: step.log for step in steps}
    write = sys.stdout.write
    write(f"{'step':<12} {'status':>6} {'seconds':>8}  output\n")
    for r in results:
        failed = ", ".join(f"{label} {status}" for label, status in r.commands.items() if status != 0)
        detail = f" (failed: {failed})" if failed else ""
        note = f" ({r.note})" if r.note else ""
        write(f"{r.name:<12} {r.returncode:>6} {r.seconds:>8.1f}  {logs[r.name]}{detail}{note}\n")
    write("summary.json: every step's exit status, the op checks' errors, the bench's and the kernels' figures\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare", help="wheels and tokenizer files into .gpu; prints the carry list and command")
    run_parser = commands.add_parser("run", help="the checks, on the CUDA machine")
    out = os.environ.get("OUT")
    run_parser.add_argument("--out", type=Path, default=Path(out) if out else None, help="default: $OUT")
    run_parser.add_argument("--work", type=Path, default=Path("/tmp/loraplex-gpu-checks"), help="scratch folder")
    run_parser.add_argument("--only", type=lambda text: text.split(","), default=None, help="steps, comma-separated")
    run_parser.add_argument("--bench-hf", action="store_true", help="bench_gpu with transformers' anchor")
    run_parser.add_argument("--deadline-s", type=int, default=DEADLINE_S, help="every step ends by then")
    run_parser.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    run_parser.add_argument("--cpu", action="store_true", help="the steps on a CPU under Triton's interpreter")
    ops_parser = commands.add_parser("ops", help="the op checks through the Triton kernels (a step of run)")
    ops_parser.add_argument("--device", default="cuda")
    ops_parser.add_argument("--dtypes", type=lambda text: text.split(","), default=list(CUDA_DTYPES))
    ops_parser.add_argument("--json", type=Path, default=None, help="write the results here")
    commands.add_parser("versions", help="the packages' versions beside the lock's (a step of run)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if args.command == "prepare":
        return prepare(ROOT)
    if args.command == "ops":
        return check_ops(args.device, args.dtypes, args.json)
    if args.command == "versions":
        return write_versions()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
