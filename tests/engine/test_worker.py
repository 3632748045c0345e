"""The engine worker without a transport: one message per step, outputs rebuilt exactly, calls, aborts, death."""

import threading
import time
from pathlib import Path

import pytest

from engine import Engine, EngineConfig, GrammarConstraint, RequestOutput, SamplingParams
from engine.drivers.worker import EngineWorker
from engine.drivers.worker_protocol import (
    AbortRequests,
    AddAdapter,
    CheckConstraint,
    GetStats,
    LogLine,
    Ready,
    Reply,
    StepOutputs,
    Submit,
    decode_command,
    decode_event,
    frame,
    frame_size,
    from_wire,
    to_wire,
)
from engine.errors import (
    AdapterBusyError,
    AdapterError,
    ConfigError,
    EngineDeadError,
    EngineError,
    RequestError,
    UnknownAdapterError,
)
from engine.memory.page_pool import OwnerKind
from engine.output.output_delta import OutputAssembler
from engine.sampling.grammar import GrammarError
from tests.engine.conftest import make_engine
from tests.engine.engine_threads import default_model_config, record_engine_threads
from tests.engine.lora_helpers import make_peft_adapter

WAIT_S = 60.0
PROMPTS = ["The quick brown fox", "def add(a, b):", "Bonjour, ça va?", "Paged attention keeps"]
# Every feature whose totals the deltas rebuild: choices, logprobs, prompt logprobs, stop strings held back.
PARAMS = [
    SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=7, temperature=0.8, seed=3, n=3, stop=("e", "at"), prompt_logprobs=1),
    SamplingParams(max_tokens=6, temperature=0.0, stop=("o",), logprobs=0, prompt_logprobs=2),
    SamplingParams(max_tokens=8, temperature=0.5, seed=1, n=2, logprobs=1, min_tokens=2),
]


def snapshot(output: RequestOutput) -> tuple:
    """An output as it reads at the moment it is handed out (its growing lists copied)."""
    return (
        output.request_id,
        output.index,
        list(output.token_ids),
        output.text,
        list(output.delta_token_ids),
        output.delta_text,
        output.finish_reason,
        output.num_cached_tokens,
        output.error,
        output.request_finished,
        None if output.logprobs is None else list(output.logprobs),
        None if output.prompt_logprobs is None else list(output.prompt_logprobs),
        list(output.prompt_token_ids),
    )


class Recorder:
    """The ``emit`` end of a worker: every StepOutputs, through the wire format, rebuilt into outputs."""

    def __init__(self, prompts: dict[str, list[int]]) -> None:
        self.messages: list[StepOutputs] = []
        self.outputs: list[tuple] = []
        self.assemblers = {request_id: OutputAssembler(ids) for request_id, ids in prompts.items()}
        self.finished = threading.Event()
        self.num_open = len(prompts)

    def emit(self, message: StepOutputs) -> None:
        body = frame(message)
        decoded = decode_event(body[4:])
        assert frame_size(body) == len(body) - 4 and isinstance(decoded, StepOutputs)
        self.messages.append(decoded)
        for delta in decoded.outputs:
            output = self.assemblers[delta.request_id].apply(delta)
            self.outputs.append(snapshot(output))
            if output.request_finished:
                self.num_open -= 1
        self.num_open -= len(decoded.rejected)
        if self.num_open == 0:
            self.finished.set()


def direct_outputs(folder: Path, prompts: dict[str, list[int]]) -> list[tuple]:
    engine = make_engine(folder)
    for (request_id, ids), params in zip(prompts.items(), PARAMS, strict=True):
        engine.add_request(ids, params, request_id)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [snapshot(output) for output in engine.step()]
    return outputs


def encoded_prompts(engine: Engine) -> dict[str, list[int]]:
    return {f"r{i}": engine.tokenizer.encode(prompt) for i, prompt in enumerate(PROMPTS)}


def test_outputs_cross_as_one_message_per_step_and_are_rebuilt_exactly(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    prompts = encoded_prompts(engine)
    recorder = Recorder(prompts)
    step = engine.step
    outputs_per_step: list[int] = []

    def counted_step() -> list[RequestOutput]:
        outputs = step()
        outputs_per_step.append(len(outputs))
        return outputs

    engine.step = counted_step
    worker = EngineWorker(engine, recorder.emit)
    for (request_id, ids), params in zip(prompts.items(), PARAMS, strict=True):
        worker.submit(Submit(request_id, ids, params, None, None, 1.0))  # queued before the loop starts
    worker.start()
    try:
        assert recorder.finished.wait(WAIT_S)
    finally:
        worker.stop()

    assert recorder.outputs == direct_outputs(tiny_llama, prompts)
    assert [len(message.outputs) for message in recorder.messages] == [n for n in outputs_per_step if n]
    assert max(outputs_per_step) > 1


def test_an_aborted_request_sends_nothing_more_and_frees_its_pages(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    seen: list[StepOutputs] = []
    first = threading.Event()

    def emit(message: StepOutputs) -> None:
        seen.append(message)
        first.set()

    worker = EngineWorker(engine, emit)
    worker.start()
    try:
        worker.submit(Submit("long", [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True), None, None, 1.0))
        assert first.wait(WAIT_S)
        worker.abort("long")
        stats = worker.stats().result(WAIT_S)  # runs after the abort: the inbox is in order
        num_seen = len(seen)
        assert stats.num_running == 0 and stats.num_waiting == 0
        assert stats.pages_by_owner[OwnerKind.KV.value] == 0
        assert worker.stats().result(WAIT_S).num_generated_tokens == stats.num_generated_tokens
        assert len(seen) == num_seen
        assert not any(delta.finish_reason for message in seen for delta in message.outputs)
    finally:
        worker.stop()


def test_aborting_some_requests_ends_them_with_a_last_output_and_leaves_the_others(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    seen: list[StepOutputs] = []
    running = threading.Event()

    def emit(message: StepOutputs) -> None:
        seen.append(message)
        if {"mine", "theirs"} <= {delta.request_id for delta in message.outputs}:
            running.set()

    worker = EngineWorker(engine, emit)
    worker.start()
    try:
        for request_id in ("mine", "theirs"):
            params = SamplingParams(max_tokens=400, ignore_eos=True)
            worker.submit(Submit(request_id, [5, 6, 7], params, None, None, 1.0))
        assert running.wait(WAIT_S)
        worker.handle(AbortRequests(["mine", "unknown"]))
        stats = worker.stats().result(WAIT_S)  # runs after the abort: the inbox is in order
        assert stats.num_running == 1
        ends = [delta for message in seen for delta in message.outputs if delta.request_finished]
        assert [(delta.request_id, delta.finish_reason) for delta in ends] == [("mine", "abort")]
    finally:
        worker.stop()


class HeldCompiles:
    """The engine's grammar compiles, held until released: a request stays "compiling" as long as a test needs."""

    def __init__(self, engine: Engine) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        compile_grammar = engine.grammars.compile

        def held(constraint: GrammarConstraint):
            self.started.set()
            assert self.release.wait(WAIT_S)
            return compile_grammar(constraint)

        engine.grammars.compile = held  # type: ignore[method-assign]


def _ends(seen: list[StepOutputs]) -> list[tuple[str, int, str | None, int]]:
    return [
        (delta.request_id, delta.index, delta.finish_reason, len(delta.new_token_ids))
        for message in seen
        for delta in message.outputs
        if delta.finish_reason
    ]


@pytest.mark.parametrize("how", ["abort_requests", "abort_all", "stop"])
def test_a_request_still_compiling_its_grammar_is_ended_answered_and_never_admitted(tiny_llama: Path, how: str) -> None:
    engine = make_engine(tiny_llama)
    compiles = HeldCompiles(engine)
    seen: list[StepOutputs] = []
    worker = EngineWorker(engine, seen.append)
    worker.start()
    try:
        params = SamplingParams(max_tokens=20, n=2, constraint=GrammarConstraint.regex("[a-z]+"))
        worker.submit(Submit("compiling", [5, 6, 7], params, None, None, 1.0))
        assert compiles.started.wait(WAIT_S)
        if how == "abort_requests":
            worker.handle(AbortRequests(["compiling"]))
        elif how == "abort_all":
            worker.abort_all()
        else:
            worker.stop()
        if how != "stop":
            worker.stats().result(WAIT_S)  # runs after the abort: the inbox is in order
        assert _ends(seen) == [("compiling", 0, "abort", 0), ("compiling", 1, "abort", 0)]
        compiles.release.set()
        if how != "stop":
            time.sleep(0.2)  # the compile is done: a request still waiting for it would be admitted now
            stats = worker.stats().result(WAIT_S)
            assert stats.num_running == stats.num_waiting == 0 and stats.num_generated_tokens == 0
            assert len(_ends(seen)) == 2 and sum(len(message.outputs) for message in seen) == 2
    finally:
        compiles.release.set()
        worker.stop()


def test_calls_answer_through_futures_and_refusals_through_the_step_message(tiny_llama: Path, tmp_path: Path) -> None:
    engine = make_engine(tiny_llama)
    messages: list[StepOutputs] = []
    adapter = make_peft_adapter(tiny_llama, tmp_path / "a", seed=0, r=4, target_modules=["q_proj"])
    worker = EngineWorker(engine, messages.append)
    worker.start()
    try:
        digest = worker.handle(AddAdapter(1, "a", str(adapter))).result(WAIT_S)
        assert len(digest) == 64 and engine.has_adapter("a")
        summary = worker.validate_adapter(adapter).result(WAIT_S)
        assert (summary.digest, summary.rank, summary.target_modules) == (digest, 4, ("q_proj",))
        assert worker.handle(GetStats(2)).result(WAIT_S).num_running == 0
        with pytest.raises(GrammarError):
            worker.handle(CheckConstraint(3, GrammarConstraint.regex("[a-"))).result(WAIT_S)
        with pytest.raises(UnknownAdapterError):
            worker.call(lambda e: e.remove_adapter("nope")).result(WAIT_S)

        worker.submit(Submit("busy", [5, 6], SamplingParams(max_tokens=300, ignore_eos=True), "a", "t", 2.0))
        worker.submit(Submit("unknown", [5, 6], SamplingParams(max_tokens=3), "nope", None, 1.0))
        worker.submit(Submit("too-long", [5] * 10, SamplingParams(max_tokens=10**6), None, None, 1.0))
        bad = GrammarConstraint.regex("[a-")  # only compiling it finds it bad
        worker.submit(Submit("bad-grammar", [5], SamplingParams(max_tokens=3, constraint=bad), None, None, 1.0))
        with pytest.raises(AdapterBusyError):
            worker.call(lambda e: e.remove_adapter("a")).result(WAIT_S)
        worker.abort("busy")
        refused = {}
        deadline = time.monotonic() + WAIT_S
        while len(refused) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
            refused = {r.request_id: from_wire(r.error) for m in list(messages) for r in m.rejected}
        assert type(refused["unknown"]) is UnknownAdapterError
        assert type(refused["too-long"]) is RequestError and "exceeds the model's context" in str(refused["too-long"])
        assert type(refused["bad-grammar"]) is GrammarError
        worker.call(lambda e: e.remove_adapter("a")).result(WAIT_S)  # free once "busy" was aborted
    finally:
        worker.stop()


def test_a_dead_step_loop_fails_every_call_and_says_so_once(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    deaths: list[BaseException] = []

    def broken_step() -> list[RequestOutput]:
        raise RuntimeError("a fault in the step")

    engine.step = broken_step  # the fault a bug in the engine would be
    worker = EngineWorker(engine, lambda _: None, on_death=deaths.append)
    worker.start()
    worker.submit(Submit("r", [5, 6], SamplingParams(max_tokens=3), None, None, 1.0))
    deadline = time.monotonic() + WAIT_S
    while not deaths and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [str(error) for error in deaths] == ["a fault in the step"]
    with pytest.raises(EngineDeadError, match="a fault in the step"):
        worker.stats().result(WAIT_S)
    worker.stop()


@pytest.mark.default_model
def test_given_a_config_the_step_thread_builds_the_engine_it_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """libgomp's pool is per thread: stepping on another thread than the builder's is slower (engine_build.py)."""
    threads = record_engine_threads(monkeypatch)
    finished = threading.Event()

    def emit(message: StepOutputs) -> None:
        if any(delta.request_finished for delta in message.outputs):
            finished.set()

    worker = EngineWorker(default_model_config(), emit)
    try:
        worker.start().result(WAIT_S)
        worker.submit(Submit("r", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True), None, None, 1.0))
        assert finished.wait(WAIT_S)
    finally:
        worker.stop()
    threads.check_stepped_where_built(worker.engine)


def test_a_config_it_cannot_build_from_fails_start_and_every_call(tmp_path: Path) -> None:
    deaths: list[BaseException] = []
    worker = EngineWorker(EngineConfig(model=str(tmp_path)), lambda _: None, on_death=deaths.append)
    queued = worker.stats()  # before the build: it waits for the engine
    with pytest.raises(ConfigError, match=r"config\.json"):
        worker.start().result(WAIT_S)
    for call in (queued, worker.stats(), worker.check_constraint(GrammarConstraint.choice(["a", "b"]))):
        with pytest.raises(EngineError, match=r"config\.json"):
            call.result(WAIT_S)
    assert not deaths, "a build that fails is the start's error, not a death"
    worker.stop()


def test_messages_and_errors_keep_their_types_across_the_wire() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, logit_bias={3: 1.5}, stop=("a",), n=2)
    submit = Submit("r", [1, 2, 3], params, "style", "tenant", 2)
    assert decode_command(frame(submit)[4:]) == Submit("r", [1, 2, 3], params, "style", "tenant", 2.0)
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    constrained = CheckConstraint(7, GrammarConstraint.json_schema(schema))
    assert decode_command(frame(constrained)[4:]) == constrained
    for event in (Ready(8192, 49152), LogLine("engine.engine", 20, "ready"), Reply(3, {"x": 1}, None)):
        assert decode_event(frame(event)[4:]) == event
    errors = (UnknownAdapterError("no such adapter"), GrammarError("bad"), AdapterBusyError("busy"), ConfigError("c"))
    for error in errors:
        rebuilt = from_wire(to_wire(error))
        assert type(rebuilt) is type(error) and str(rebuilt) == str(error)
    assert isinstance(from_wire(to_wire(UnknownAdapterError("x"))), AdapterError | RequestError)
    other = from_wire(to_wire(ValueError("odd")))
    assert type(other) is EngineError and "ValueError: odd" in str(other)
