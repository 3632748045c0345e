"""LoRA as SGMV: shrink and expand over segments of rows that share an adapter, on Triton, native CPU and torch."""
