"""The OpenAI-compatible API: chat completions, completions and models (chat/), and the Responses API (responses/)."""
