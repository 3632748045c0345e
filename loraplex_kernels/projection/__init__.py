"""The projections: GEMMs over each weight format (bf16, packed, int8 with VNNI), and gate/up fused with SiLU."""
