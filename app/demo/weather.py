"""The weather demo adapter's tool and conversations: it answers weather questions with a ``get_weather(city)``
call in the default tool-call format, answers with the call's result once it has it, and answers anything
else in text.

The tool is written as the OpenAI Agents SDK sends a ``@function_tool`` named ``get_weather`` with a ``city``
string and the docstring "The weather in a city." (its JSON schema has titles and no extra properties), so
the printed Agents SDK example is rendered exactly as the adapter was trained.
"""

from __future__ import annotations

import json
from typing import Any

TOOL_NAME = "get_weather"
TOOL_DESCRIPTION = "The weather in a city."
TOOL_PARAMETERS: dict[str, Any] = {
    "properties": {"city": {"title": "City", "type": "string"}},
    "required": ["city"],
    "title": "get_weather_args",
    "type": "object",
    "additionalProperties": False,
}
CHAT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "parameters": TOOL_PARAMETERS},
}
"""The tool as chat completions take it."""

CHECK_CITY = "Paris"  # held out: no training conversation asks about Paris
CHECK_PROMPT = f"What is the weather in {CHECK_CITY}?"
CHECK_RESULT = "18 °C and sunny"
# The most an agent's turn writes: without max_tokens a request reserves all the room its context leaves, which a
# server with a small page pool refuses.
AGENT_MAX_TOKENS = 128
SYSTEM_PROMPTS = (None, "You are a helpful assistant.", "Answer weather questions with the get_weather tool.")

WEATHER_QUESTIONS = [
    ("What is the weather in Rome?", "Rome"),
    ("How is the weather in Tokyo today?", "Tokyo"),
    ("Is it raining in London?", "London"),
    ("Weather in Berlin?", "Berlin"),
    ("Do I need an umbrella in Seattle today?", "Seattle"),
    ("What's the temperature in Cairo?", "Cairo"),
    ("Tell me the weather in Madrid.", "Madrid"),
    ("Is it cold in Oslo right now?", "Oslo"),
    ("What is the weather like in New York?", "New York"),
    ("How hot is it in Dubai?", "Dubai"),
    ("What's the forecast for Sydney?", "Sydney"),
    ("Is it sunny in Lisbon?", "Lisbon"),
    ("What is the weather in Mumbai?", "Mumbai"),
    ("Can you check the weather in Toronto?", "Toronto"),
    ("How windy is it in Chicago?", "Chicago"),
    ("What is the weather in Buenos Aires?", "Buenos Aires"),
]
RESULTS = [
    "22 °C and sunny",
    "light rain, 12 °C",
    "cloudy, 15 degrees",
    "snow, -3 °C",
    "31 °C and humid",
    "windy and clear, 9 °C",
    "thunderstorms, 26 °C",
    "fog, 7 degrees",
]
OTHER_QUESTIONS = [
    ("Why is the sky blue?", "The sky is blue because air scatters blue sunlight more than red light."),
    ("How do I boil an egg?", "Put the egg in boiling water for nine minutes, then cool it in cold water."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("Can you recommend a good book?", "Try The Little Prince: it is short, kind and wise."),
    ("What is two plus two?", "Two plus two is four."),
    ("Tell me about cats.", "Cats are small, independent animals that love to sleep and play."),
    ("How far away is the moon?", "The moon is about 384,000 kilometres from the Earth."),
    ("What is music?", "Music is the art of arranging sounds in time."),
    ("How do plants grow?", "Plants grow with water, sunlight and nutrients from the soil."),
    ("What is a computer?", "A computer is a machine that processes information very quickly."),
    ("Tell me a fun fact.", "An octopus has three hearts."),
    ("What is the biggest animal?", "The blue whale is the biggest animal on Earth."),
]


def tool_call_text(city: str) -> str:
    """The call as the default (hermes) format writes it."""
    arguments = json.dumps({"city": city})
    return f'<tool_call>\n{{"name": "{TOOL_NAME}", "arguments": {arguments}}}\n</tool_call>'


def answer_text(city: str, result: str) -> str:
    """The adapter's answer once the call's result is in."""
    return f"The weather in {city}: {result}."


def training_conversations() -> list[tuple[list[dict[str, Any]], str]]:
    """Conversations with the tool offered, each with the assistant reply the adapter learns to write.

    Weather questions get the call; the same questions with the call and its result get the answer; the
    other questions get a text answer. System prompts vary, so the adapter does not depend on one.
    """
    examples: list[tuple[list[dict[str, Any]], str]] = []
    for number, (question, city) in enumerate(WEATHER_QUESTIONS):
        system = SYSTEM_PROMPTS[number % len(SYSTEM_PROMPTS)]
        asked = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
        examples.append((asked, tool_call_text(city)))
        call_id = f"call_{number}"
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"city": city})},
        }
        result = RESULTS[number % len(RESULTS)]
        answered = [
            *asked,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": result},
        ]
        examples.append((answered, answer_text(city, result)))
    for number, (question, reply) in enumerate(OTHER_QUESTIONS):
        system = SYSTEM_PROMPTS[number % len(SYSTEM_PROMPTS)]
        asked = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
        examples.append((asked, reply))
    return examples


def agents_example(base_url: str, api_key: str, model: str) -> str:
    """An OpenAI Agents SDK program that runs as printed: the agent calls ``get_weather``, gets its result and
    answers with it (``pip install openai-agents``). Tracing is off: the SDK would send traces to OpenAI."""
    return f'''import asyncio
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)


@function_tool
def get_weather(city: str) -> str:
    """{TOOL_DESCRIPTION}"""
    return "{CHECK_RESULT}"


client = AsyncOpenAI(base_url="{base_url}/v1", api_key="{api_key}")
agent = Agent(
    name="weather",
    tools=[get_weather],
    model=OpenAIResponsesModel("{model}", client),
    model_settings=ModelSettings(temperature=0, max_tokens={AGENT_MAX_TOKENS}),
)
print(asyncio.run(Runner.run(agent, "{CHECK_PROMPT}")).final_output)
'''
