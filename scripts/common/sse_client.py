"""One streaming OpenAI request over httpx, read to ``data: [DONE]`` and timed, as a load generator sees it.

A request counts as an error, whose ``error_kind`` says why, when: the answer is not a 200 (``http_<status>``),
an event in the stream is an error body (``error_event``), not JSON (``bad_event``) or not UTF-8 (``bad_utf8``),
the stream ends without ``data: [DONE]`` (``no_done``) or goes on after it (``after_done``), or the connection
fails (``connect``, ``timeout``, ``protocol``, ``transport``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

DONE = "[DONE]"
DATA_PREFIX = "data: "
MAX_DETAIL_CHARS = 300  # of an error body or exception text kept for the report


@dataclass(slots=True)
class StreamResult:
    """What one streamed request did: its timings, its tokens, and why it failed if it did."""

    started_at: float
    """time.perf_counter() when the request was sent."""
    ended_at: float = 0.0
    error_kind: str | None = None
    error_detail: str = ""
    ttft_s: float | None = None
    """From sending the request to the first event that carries text."""
    itl_s: list[float] = field(default_factory=list)
    """Gaps between successive events that carry text."""
    num_text_events: int = 0
    completion_tokens: int | None = None
    """From the usage event (``stream_options.include_usage``)."""

    @property
    def ok(self) -> bool:
        return self.error_kind is None


async def stream_request(http: httpx.AsyncClient, path: str, body: dict[str, Any], api_key: str) -> StreamResult:
    """POST ``body`` (with ``stream: true``) to ``path`` and read its SSE answer to the end."""
    result = StreamResult(started_at=time.perf_counter())
    headers = {"Authorization": f"Bearer {api_key}"}
    try:
        async with http.stream("POST", path, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                _fail(result, f"http_{response.status_code}", text)
            else:
                await _read_events(response, result)
    except httpx.ConnectError as error:
        _fail(result, "connect", repr(error))
    except httpx.TimeoutException as error:
        _fail(result, "timeout", repr(error))
    except httpx.RemoteProtocolError as error:
        _fail(result, "protocol", repr(error))
    except httpx.HTTPError as error:
        _fail(result, "transport", repr(error))
    except UnicodeDecodeError as error:
        _fail(result, "bad_utf8", repr(error))
    result.ended_at = time.perf_counter()
    return result


async def _read_events(response: httpx.Response, result: StreamResult) -> None:
    last_text_at: float | None = None
    done = False
    async for line in _sse_lines(response):
        if not line.startswith(DATA_PREFIX):
            continue  # the blank line that ends each event
        payload = line[len(DATA_PREFIX) :]
        if done:
            _fail(result, "after_done", payload)
            return
        if payload == DONE:
            done = True
            continue
        try:
            event = json.loads(payload)
        except ValueError:
            _fail(result, "bad_event", payload)
            return
        if "error" in event:
            _fail(result, "error_event", payload)
            return
        if event.get("usage"):
            result.completion_tokens = event["usage"]["completion_tokens"]
        if _text(event):
            now = time.perf_counter()
            if last_text_at is None:
                result.ttft_s = now - result.started_at
            else:
                result.itl_s.append(now - last_text_at)
            last_text_at = now
            result.num_text_events += 1
    if not done:
        _fail(result, "no_done", "the stream ended without data: [DONE]")


async def _sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The body's lines as SSE ends them: at LF (a CR before it dropped).

    Not httpx's ``aiter_lines``: it splits like ``str.splitlines``, also at U+2028, U+2029 and U+0085, which
    JSON leaves unescaped inside strings, so a token holding one would cut its event in two.
    """
    pending = b""
    async for chunk in response.aiter_bytes():
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r").decode()
    if pending:
        yield pending.removesuffix(b"\r").decode()


def _text(event: dict[str, Any]) -> str:
    """The text an event carries: a chat chunk's ``delta.content`` or a completion chunk's ``text``."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def _fail(result: StreamResult, kind: str, detail: str) -> None:
    result.error_kind = kind
    result.error_detail = " ".join(detail.split())[:MAX_DETAIL_CHARS]
