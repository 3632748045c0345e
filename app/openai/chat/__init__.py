"""Chat completions, completions and the model list: the request bodies, their checks, the prompt, the metered run
through the engine, tool calls, and the replies as JSON or SSE chunks."""
