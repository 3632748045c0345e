"""The Responses stream's items with ``auto`` tools, from the model's text as it arrives in the default format."""

from __future__ import annotations

import json
from typing import Any

from app.openai.responses.items import OutputFunctionCall, OutputMessage
from app.openai.responses.tool_stream import ToolItemStream
from app.tool_calls import DEFAULT_FORMAT, get_format

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _stream(text: str, status: str = "completed", step: int = 5) -> tuple[list[dict[str, Any]], ToolItemStream]:
    sent: list[dict[str, Any]] = []

    def event(kind: str, **fields: Any) -> bytes:
        sent.append({"type": kind, **fields})
        return b""

    items = ToolItemStream(event, get_format(DEFAULT_FORMAT), "msg_first")
    for start in range(0, len(text), step):
        list(items.feed(text[start : start + step]))
    list(items.finish(status))
    return sent, items


def test_text_then_a_call_stream_as_two_items_with_the_arguments_in_fragments() -> None:
    sent, items = _stream("Let me check.\n" + CALL)
    kinds = [event["type"] for event in sent]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert kinds.count("response.output_text.delta") >= 2  # the text streams before the call opens
    message_done = kinds.index("response.output_item.done")
    call_added = kinds.index("response.output_item.added", 1)
    assert message_done < call_added
    assert kinds[call_added + 1 : -2] == ["response.function_call_arguments.delta"] * (len(kinds) - call_added - 3)
    assert len(kinds) - call_added - 3 >= 2  # the arguments came in fragments, as generated
    assert kinds[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]
    fragments = "".join(event["delta"] for event in sent if event["type"] == "response.function_call_arguments.delta")
    assert json.loads(fragments) == {"city": "Paris"} == json.loads(sent[-2]["arguments"])
    message, call = items.items
    assert isinstance(message, OutputMessage) and message.id == "msg_first"
    assert message.content[0].text == "Let me check." and message.status == "completed"
    assert isinstance(call, OutputFunctionCall) and call.name == "get_weather" and call.status == "completed"
    assert sent[call_added]["output_index"] == 1 and sent[call_added]["item"].arguments == ""
    assert sent[-1]["item"] == call and call.call_id.startswith("call_") and call.id.startswith("fc_")


def test_a_call_alone_makes_no_message_and_a_cut_call_is_incomplete() -> None:
    sent, items = _stream(CALL + "\n")
    assert [type(item) for item in items.items] == [OutputFunctionCall]
    assert sent[0]["output_index"] == 0

    _, cut = _stream(CALL[:40], status="incomplete")
    assert len(cut.items) == 1 and cut.items[0].status == "incomplete"


def test_text_alone_is_one_message_and_nothing_is_an_empty_one() -> None:
    _, items = _stream("The capital of France is Paris.")
    assert [item.content[0].text for item in items.items] == ["The capital of France is Paris."]
    _, empty = _stream("")
    assert [item.content[0].text for item in empty.items] == [""]
