"""The loraplex engine: sequences, the page pool, the scheduler, the model forward and sampling."""

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ConfigError, EngineError, PoolExhaustedError, RequestError, RequestFailedError
from engine.output.outputs import EngineStats, RequestOutput
from engine.sampling.grammar import GrammarConstraint, GrammarError, GrammarKind
from engine.sampling.sampling_params import SamplingParams

__all__ = [
    "ConfigError",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "GrammarConstraint",
    "GrammarError",
    "GrammarKind",
    "PoolExhaustedError",
    "RequestError",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
]
