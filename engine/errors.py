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


class RequestFailedError(EngineError):
    """The engine failed while running this one request (a bug or a fault); the other requests went on."""


class AdapterError(EngineError):
    """A LoRA adapter cannot be loaded; the message names the file, setting or tensor at fault."""


class AdapterNotFoundError(AdapterError):
    """The adapter folder, or one of the files a PEFT LoRA folder must hold, is missing."""


class AdapterFormatError(AdapterError):
    """The adapter's files are unreadable or inconsistent: bad JSON, pickled or corrupt weights, bad tensors."""


class UnsupportedAdapterError(AdapterError):
    """The adapter uses a PEFT feature the engine does not serve (DoRA, biases, embedding LoRA, …)."""


class AdapterMismatchError(AdapterError):
    """The adapter was made for a different base model: its modules or tensor shapes do not fit this one."""


class AdapterBusyError(AdapterError):
    """The adapter cannot be removed or replaced while requests use it."""


class UnknownAdapterError(AdapterError, RequestError):
    """A request or call names an adapter that was never added (or was removed)."""
