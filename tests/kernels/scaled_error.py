"""The comparison the projection kernels' tests make: the largest scaled error against a float64 reference."""

import torch

TOLERANCE = 1e-4  # |actual - expected| / (1 + |expected|): fp32 summation against float64


def assert_scaled_close(actual: torch.Tensor, expected: torch.Tensor, seed: int, tolerance: float = TOLERANCE) -> None:
    """``actual`` has ``expected``'s shape and is within ``tolerance`` of it in scaled error; ``seed`` replays a
    failing case."""
    assert actual.shape == expected.shape, f"seed={seed}"
    if not actual.numel():
        return
    error = ((actual.double() - expected.double()).abs() / (1 + expected.double().abs())).max().item()
    assert error <= tolerance, f"scaled error {error:.2e} (seed={seed})"
