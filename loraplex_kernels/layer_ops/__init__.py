"""A decoder layer's glue ops: add + RMS norm, SiLU·mul, RoPE with the K/V write, the K/V row index, argmax of rows."""
