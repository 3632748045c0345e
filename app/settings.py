"""Settings read from the environment once, at the edge of the program."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from app.model_store import DEFAULT_MODEL_SPEC

APP_NAME = "loraplex"


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the process reads from its environment, typed and read once."""

    home: Path
    """Data folder for the converted model, the adapter store and the embedded database (LORAPLEX_HOME)."""

    model: str
    """Base model: "default" (SmolLM2-135M-Instruct) or a local Hugging Face model folder (LORAPLEX_MODEL)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Build settings from `environ` (default: the process environment); empty values count as unset."""
        env = os.environ if environ is None else environ
        home = env.get("LORAPLEX_HOME") or platformdirs.user_data_dir(APP_NAME)
        return cls(
            home=Path(home).expanduser(),
            model=env.get("LORAPLEX_MODEL") or DEFAULT_MODEL_SPEC,
        )
