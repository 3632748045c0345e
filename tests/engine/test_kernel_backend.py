"""The ``kernels`` setting: auto takes the native CPU ops when they build, native that cannot build is a
ConfigError that says why, auto then falls back to torch (and still serves), and bad values are refused."""

import logging
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.errors import ConfigError
from loraplex_kernels import native_cpu
from loraplex_kernels.backend import KernelBackend
from tests.engine.conftest import make_engine
from tests.native_required import require_native_ops


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch):
    """The loader as on a machine without a C++ compiler: CXX names none, and the per-process result is
    forgotten before and after, so the real library is found again by the next test."""
    monkeypatch.setenv("CXX", "loraplex-test-no-such-compiler")
    native_cpu._build_once.cache_clear()
    yield
    native_cpu._build_once.cache_clear()


def test_auto_runs_the_native_kernels_where_they_build(tiny_llama: Path) -> None:
    require_native_ops()
    engine = make_engine(tiny_llama)
    assert engine.kernels is KernelBackend.NATIVE
    assert engine.model.backend is KernelBackend.NATIVE


def test_native_without_a_compiler_is_a_config_error(no_compiler, tiny_llama: Path) -> None:
    assert native_cpu.native_ops() is None
    with pytest.raises(ConfigError, match=r"kernels='native' cannot be used: no C\+\+ compiler.*kernels='torch'"):
        make_engine(tiny_llama, kernels="native")


def test_auto_without_a_compiler_falls_back_to_torch_and_serves(
    no_compiler, tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="engine.config"):
        engine = make_engine(tiny_llama, kernels="auto")
    assert engine.kernels is KernelBackend.TORCH
    assert "no C++ compiler" in caplog.text
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    [output] = engine.generate([[5, 6, 7, 8, 9]], params)
    assert len(output.token_ids) == 4


def test_native_refuses_other_dtypes_and_bad_values_are_refused(tiny_llama: Path) -> None:
    config = EngineConfig(model=str(tiny_llama), kernels="native", dtype="float16")
    with pytest.raises(ConfigError, match="float32 or bfloat16 models only"):
        config.kernel_backend(torch.device("cpu"), torch.float16, 64)
    assert config.kernel_backend(torch.device("cpu"), torch.bfloat16, 64) is KernelBackend.NATIVE
    with pytest.raises(ConfigError, match="multiple of 8"):
        config.kernel_backend(torch.device("cpu"), torch.float32, 20)
    with pytest.raises(ConfigError, match="CPU only"):
        config.kernel_backend(torch.device("cuda"), torch.float32, 64)
    assert EngineConfig(model="x", kernels="auto").kernel_backend(torch.device("cuda"), torch.bfloat16, 64) is (
        KernelBackend.TRITON
    )
    with pytest.raises(ConfigError, match="kernels must be one of auto, torch, native, triton"):
        EngineConfig(model="x", kernels="cuda")


@pytest.mark.parametrize(
    ("machine", "outcome"), [("x86_64", pytest.fail.Exception), ("riscv64", pytest.skip.Exception)]
)
def test_a_missing_native_library_fails_the_tests_on_a_cpu_it_builds_for(
    no_compiler, monkeypatch: pytest.MonkeyPatch, machine: str, outcome: type[BaseException]
) -> None:
    """A broken native build on a developer's x86-64 machine must show as a failure, not as skips; CI or not."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr("platform.machine", lambda: machine)
    with pytest.raises(outcome, match="no C\\+\\+ compiler"):
        require_native_ops()
