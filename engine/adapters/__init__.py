"""LoRA adapters: PEFT folders validated, laid out in pages, kept in tiers, copied in, and each step's LoRA tables."""
