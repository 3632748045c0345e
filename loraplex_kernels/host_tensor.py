"""Host tensors from Python lists of numbers, converted in one C loop.

``torch.tensor(values)`` converts a list one element at a time, which on the lists of a step's rows (hundreds
of ints) or of its adapters' rows (thousands) costs several times what the conversion through an ``array``
does; the tensor then shares the array's buffer.
"""

from array import array
from collections.abc import Iterable

import torch

_ARRAY_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}


def host_tensor(values: Iterable[int] | Iterable[float], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D host tensor of ``values`` (Python numbers): [len(values)] ``dtype``, int64, int32 or float32. An int
    that does not fit ``dtype`` raises OverflowError."""
    buffer = array(_ARRAY_TYPECODES[dtype], values)
    return torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)
