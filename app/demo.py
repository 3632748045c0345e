"""What `loraplex serve` does until the HTTP gateway exists: run the engine on a few prompts.

It shows the engine's answers, generated together in one continuous batch, and the throughput.
"""

import logging
import sys
import time

from app.model_store import resolve_model
from app.settings import Settings
from engine import Engine, EngineConfig, SamplingParams

logger = logging.getLogger(__name__)

DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a GPU is.",
    "Give me three tips for a good night's sleep.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
)
DEMO_MAX_TOKENS = 64


def run_demo(settings: Settings) -> None:
    folder = resolve_model(settings.model, settings.home)
    engine = Engine(EngineConfig(model=str(folder)))
    prompts = [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        for question in DEMO_QUESTIONS
    ]
    params = SamplingParams(max_tokens=DEMO_MAX_TOKENS, temperature=0.0)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(output.token_ids) for output in outputs)
    out = sys.stdout
    for question, output in zip(DEMO_QUESTIONS, outputs, strict=True):
        out.write(f"\n> {question}\n{output.text.strip()}\n")
    out.write(
        f"\n{len(outputs)} requests in one continuous batch: {num_tokens} tokens in {elapsed:.2f} s "
        f"({num_tokens / elapsed:.1f} tokens/s)\n"
    )
    out.flush()
