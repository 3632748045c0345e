"""scripts/tools/gpu_checks.py without a GPU: the plan turns the interpreter off and points bench_gpu at the
carried tokenizer, the deselected tests exist, and only wheels for the device's CPython 3.12 on manylinux x86-64
are taken."""

import ast
from pathlib import Path

import pytest

from scripts.tools import gpu_checks, gpu_prepare
from scripts.tools.timed_steps import Step

ROOT = Path(__file__).resolve().parents[2]


def test_the_plan_runs_the_kernels_compiled_and_the_bench_on_the_carried_tokenizer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert gpu_checks.main(["run", "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "TRITON_INTERPRET=0" in plan
    assert [line.split(":")[0] for line in plan.splitlines() if not line.startswith((" ", "missing"))][-7:] == [
        "nvidia-smi",
        "setup",
        "op-checks",
        "bench",
        "tests",
        "kernels",
        "phases",
    ]
    phases = [line for line in plan.splitlines() if "host_step_phases" in line]
    assert len(phases) == 2 and all("--cuda" in line and "--model-dir" in line for line in phases)
    bench = next(line for line in plan.splitlines() if "bench_gpu --json" in line)
    assert f"--tokenizer-dir {ROOT / '.gpu' / 'tokenizer'}" in bench and "--skip-hf" in bench
    assert "--dtypes float32,float16,bfloat16" in plan
    kernels = next(line for line in plan.splitlines() if "bench_triton_kernels" in line)
    assert "--sweep --json" in kernels and "--quick" not in kernels
    assert plan.count("pytest -x -q") == len(gpu_checks.TEST_FILES)

    assert gpu_checks.main(["run", "--dry-run", "--cpu", "--bench-hf", "--only", "bench"]) == 0
    plan = capsys.readouterr().out
    assert "TRITON_INTERPRET=1" in plan and "--quick" in plan and "--skip-hf" not in plan
    assert "op-checks" not in plan
    assert gpu_checks.main(["run", "--dry-run", "--only", "benchmark"]) == 2


def test_every_deselected_test_exists_in_a_file_the_step_runs() -> None:
    for path, test, _ in gpu_checks.DESELECTED_TESTS:
        assert path in gpu_checks.TEST_FILES
        tree = ast.parse((ROOT / path).read_text())
        names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert test in names, f"{path} has no {test}: drop it from DESELECTED_TESTS"


def test_the_bench_json_line_is_kept_apart_from_other_output(tmp_path: Path) -> None:
    stdout = tmp_path / "stdout.txt"
    stdout.write_text('a stray line\n{"tok_s_base": 1.5}\n\n')
    step = Step("bench", (), "bench.log", 1, stdout=stdout)
    assert gpu_checks.collect_json(step, tmp_path, "bench_gpu.json") == {"tok_s_base": 1.5}
    assert (tmp_path / "bench_gpu.json").read_text() == '{"tok_s_base": 1.5}\n'
    assert "a stray line" in (tmp_path / "bench.log").read_text()
    stdout.write_text("Traceback: no JSON\n")
    assert gpu_checks.collect_json(step, tmp_path, "bench_gpu.json") is None


@pytest.mark.parametrize(
    ("wheel", "runs"),
    [
        ("platformdirs-4.14.9-py3-none-any.whl", True),
        ("msgspec-0.23.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),
        ("orjson-3.13.0-cp39-abi3-manylinux_2_28_x86_64.whl", True),
        ("msgspec-0.23.0-cp311-cp311-manylinux_2_17_x86_64.whl", False),
        ("msgspec-0.23.0-cp312-cp312-manylinux_2_17_aarch64.whl", False),
        ("msgspec-0.23.0-cp312-cp312-win_amd64.whl", False),
    ],
)
def test_only_wheels_for_the_device_python_are_taken(wheel: str, runs: bool) -> None:
    assert gpu_prepare.runs_on_device(wheel) is runs
