"""The native greedy choice against torch.argmax: widths with and without a tail past the vectors, ties
(the first maximum wins), NaN (the first NaN wins), rows of -inf, strided rows, and bad inputs."""

import random

import pytest
import torch

from loraplex_kernels.backend import KernelBackend
from loraplex_kernels.layer_ops.argmax_rows import argmax_rows


def check(logits: torch.Tensor, seed: int) -> None:
    actual = argmax_rows(logits, KernelBackend.NATIVE)  # [num_rows]
    assert actual.dtype == torch.int64
    assert torch.equal(actual, logits.argmax(dim=-1)), f"seed={seed}"


@pytest.mark.parametrize("width", [49152, 1000, 37, 16, 8, 1])  # the default model's vocabulary, tails, one
@pytest.mark.parametrize("num_rows", [1, 7, 64])
def test_random_rows_match_torch(native, width: int, num_rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    check(torch.randn(num_rows, width, generator=gen) * 10, seed)  # [num_rows, width]


@pytest.mark.parametrize("width", [49152, 37])
def test_ties_take_the_first_maximum(native, width: int, seed: int):
    rng = random.Random(seed)
    logits = torch.randn(9, width, generator=torch.Generator().manual_seed(seed))  # [9, width]
    for row in range(9):
        places = sorted(rng.sample(range(width), 3))
        logits[row, places] = 50.0  # three copies of the maximum, one of them maybe in the scalar tail
    logits[8] = 1.0  # every value the maximum
    logits[7, width - 1] = 60.0  # the maximum in the last lane
    check(logits, seed)


def test_nan_wins_and_the_first_nan_is_taken(native, seed: int):
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(seed))  # [4, 1000]
    logits[0, 500] = float("nan")
    logits[1, [3, 700]] = float("nan")
    logits[1, 10] = float("inf")
    logits[2, 999] = float("nan")  # in the tail past the last full vector
    logits[3] = float("-inf")  # every value -inf: the first index
    check(logits, seed)


def test_strided_rows_as_the_sampler_passes_them(native, seed: int):
    logits = torch.randn(70, 49152, generator=torch.Generator().manual_seed(seed))  # [70, vocab]
    check(logits[:64], seed)  # the sampled rows ahead of scored prompt rows
    check(logits[::2], seed)  # rows further apart than their width


def test_bad_inputs_are_refused(native):
    with pytest.raises(ValueError, match="contiguous rows"):
        argmax_rows(torch.randn(8, 4).t(), KernelBackend.NATIVE)
    with pytest.raises(ValueError, match="num_rows, width > 0"):
        argmax_rows(torch.randn(8, 0), KernelBackend.NATIVE)
    other_dtype = torch.randn(3, 5).double()  # [3, 5]: not the op's dtype, so torch's argmax answers
    assert torch.equal(argmax_rows(other_dtype, KernelBackend.NATIVE), other_dtype.argmax(dim=-1))
