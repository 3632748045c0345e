"""The OpenAI-compatible API: chat completions, completions and models."""
