"""torch's thread count for a block of a test, set back after it (the native ops share work among as many
OpenMP threads as torch is told)."""

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Runs the block with ``count`` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
