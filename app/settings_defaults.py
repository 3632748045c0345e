"""The settings' defaults and choices that the modules they configure state too.

app/settings.py reads the environment against these values, and the modules that use them (the request
bodies' schemas, the tool-call formats) import them from here, so the settings import none of those modules.
"""

from __future__ import annotations

DEFAULT_MAX_N = 16  # choices per request (LORAPLEX_MAX_N)
DEFAULT_MAX_PROMPTS = 64  # prompts per completions request (LORAPLEX_MAX_PROMPTS)
# The tool-call formats' names (LORAPLEX_TOOL_CALL_FORMAT), the default first; app/tool_calls/formats.py
# registers one format under each name.
TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral", "pythonic")
DEFAULT_TOOL_CALL_FORMAT = TOOL_CALL_FORMATS[0]
