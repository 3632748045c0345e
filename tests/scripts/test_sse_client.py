"""The load test's SSE reader: what counts as a complete stream, what as an error, and how it splits events."""

import asyncio
import json

import httpx

from scripts.common.sse_client import StreamResult, stream_request

CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def chat_chunk(content: str) -> bytes:
    event = {"choices": [{"index": 0, "delta": {"content": content}}]}
    return b"data: " + json.dumps(event, ensure_ascii=False).encode()  # as the server writes it: UTF-8, unescaped


def read(body: bytes, status: int = 200) -> StreamResult:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))

    async def go() -> StreamResult:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await stream_request(http, "/v1/chat/completions", CHAT_BODY, "key")

    return asyncio.run(go())


def test_a_stream_read_to_done_counts_its_text_events_and_usage() -> None:
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}'
    body = b"\n\n".join([chat_chunk(""), chat_chunk("Hel"), chat_chunk("lo"), usage, b"data: [DONE]", b""])

    result = read(body)

    assert result.ok, result.error_detail
    assert result.num_text_events == 2 and len(result.itl_s) == 1
    assert result.ttft_s is not None and result.ttft_s >= 0
    assert result.completion_tokens == 2


def test_line_separators_inside_json_strings_do_not_split_an_event() -> None:
    # U+2028, U+2029 and U+0085 stay unescaped in JSON; SSE ends lines at LF only (CRLF also accepted).
    body = b"\r\n\r\n".join([chat_chunk("a\u2028b"), chat_chunk("c\u2029\x85d"), b"data: [DONE]", b""])

    result = read(body)

    assert result.ok, result.error_detail
    assert result.num_text_events == 2


def test_a_stream_without_done_is_an_error() -> None:
    result = read(chat_chunk("Hello") + b"\n\n")

    assert result.error_kind == "no_done"


def test_an_error_event_is_an_error() -> None:
    error = b'data: {"error": {"message": "The engine stopped", "type": "server_error", "param": null, "code": null}}'

    result = read(chat_chunk("Hel") + b"\n\n" + error + b"\n\n")

    assert result.error_kind == "error_event"
    assert "engine stopped" in result.error_detail


def test_a_refused_request_is_an_error_named_by_its_status() -> None:
    result = read(b'{"error": {"message": "slow down"}}', status=429)

    assert result.error_kind == "http_429"
    assert "slow down" in result.error_detail
