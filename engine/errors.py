"""Typed errors the engine raises; each message says what was wrong and what to do."""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ConfigError(EngineError):
    """The engine or model configuration cannot work."""


class RequestError(EngineError):
    """A request cannot be served as asked (too long, bad sampling parameters)."""


class PoolExhaustedError(EngineError):
    """The page pool cannot hold even one request of this size."""


class EngineDeadError(EngineError):
    """The engine's step loop stopped after an unexpected error; no more requests are accepted."""
