"""host_tensor: what torch.tensor gives for a list of numbers, through one array."""

import gc

import pytest
import torch

from loraplex_kernels.host_tensor import host_tensor


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_the_values_and_dtype_of_torch_tensor(dtype: torch.dtype) -> None:
    values = [0, 1, -7, 2**31 - 1, -(2**31)] + ([2**40] if dtype is torch.int64 else [])
    if dtype is torch.float32:
        values = [0.0, 1.5, -2.25, 3e30]
    made = host_tensor(values, dtype)
    assert made.dtype == dtype and made.shape == (len(values),)
    assert torch.equal(made, torch.tensor(values, dtype=dtype))
    assert torch.equal(host_tensor(iter(values), dtype), made)  # any iterable


def test_an_empty_list_and_an_int_too_wide() -> None:
    assert host_tensor([], torch.int32).shape == (0,)
    with pytest.raises(OverflowError):
        host_tensor([2**31], torch.int32)


def test_the_tensor_keeps_its_buffer() -> None:
    made = host_tensor(list(range(1000)))
    gc.collect()
    _ = [list(range(1000)) for _ in range(100)]  # memory a freed buffer would be reused for
    assert made.tolist() == list(range(1000))
