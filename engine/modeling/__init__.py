"""The model: the forward pass over the pool, its weights, RoPE, the precision and which GEMM computes it."""
