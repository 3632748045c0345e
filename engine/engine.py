"""The engine: requests in, tokens out, one step at a time (schedule, run, update)."""

import itertools
import logging
import math
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer

from engine.adapter_cache import AdapterCache
from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import ConfigError, PoolExhaustedError, RequestError
from engine.fair_queue import FairQueue
from engine.grammar import GrammarCompiler, GrammarState
from engine.host_memory import keep_large_buffers_in_heap
from engine.kv_cache_manager import KVCacheManager
from engine.lora_adapter import LoraAdapter, load_lora_adapter
from engine.model import LlamaModel
from engine.outputs import EngineStats, RequestOutput
from engine.page_pool import make_pool
from engine.precision import dtype_name
from engine.request_limits import RequestLimits
from engine.request_queue import FifoQueue, RequestQueue
from engine.sampler import sample
from engine.sampling_batch import build_sampling_batch
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.sequence import DEFAULT_TENANT, FinishReason, Sequence
from engine.speculation import Speculator
from engine.step_batch import build_step_batch
from engine.step_result import StepResult, fork_choices, prompt_scores
from engine.token_bytes import TokenBytes
from engine.verification import Verified, accept, generator_states, rewind_generators
from engine.weights import load_weights

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

QUEUE_BY_POLICY: dict[str, type[RequestQueue]] = {"fair": FairQueue, "fifo": FifoQueue}


class Engine:
    """Serves many concurrent requests over one model with a paged KV cache (docs/architecture.md#the-engine)."""

    def __init__(self, config: EngineConfig) -> None:
        """Load the model, size the page pool and pick the kernels; raises ConfigError when they cannot work."""
        self.config = config
        folder = Path(config.model)
        self.model_config = ModelConfig.from_folder(folder)
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        if self.device.type == "cpu":
            keep_large_buffers_in_heap()
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.token_bytes = TokenBytes(self.tokenizer)
        self.kernels = config.kernel_backend(self.device, self.dtype, self.model_config.head_dim)
        self.precision = config.precision(self.device, self.kernels, self.model_config.gate_up_shape)
        weights = load_weights(folder, self.model_config, self.precision, self.device, self.kernels)
        self.max_model_len = self.model_config.max_model_len
        self.model = LlamaModel(self.model_config, weights, self.max_model_len, self.kernels)
        self.pool = make_pool(config, self.model_config, self.precision.kv_dtype, self.device)
        self.kv = KVCacheManager(self.pool, config.enable_prefix_caching)
        self.limits = RequestLimits(
            self.model_config.vocab_size,
            config.max_num_seqs,
            self.max_model_len,
            self.pool.num_pages,
            self.pool.block_size,
        )
        self.adapters = AdapterCache(self.pool, self.model_config, config.max_host_adapter_bytes)
        self.speculator = (
            Speculator(
                config.num_speculative_tokens,
                config.prompt_lookup_min,
                config.prompt_lookup_max,
                config.speculative_max_step_tokens,
            )
            if config.num_speculative_tokens
            else None
        )
        self.scheduler = Scheduler(
            self.kv,
            self.adapters,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            QUEUE_BY_POLICY[config.scheduling_policy](),
            self.speculator,
        )
        self._eos_ids = frozenset(self.model_config.eos_token_ids) | frozenset(
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, sorted(self._eos_ids))
        self._requests: dict[str, list[Sequence]] = {}  # every choice of each unfinished request
        self._ids = itertools.count()
        self._totals = {"preemptions": 0, "prompt": 0, "cached": 0, "generated": 0, "prefill": 0}
        logger.info(
            "engine ready: %s on %s with the %s kernels, %d pages of %d tokens (%.0f MiB); %s",
            folder.name,
            self.device,
            self.kernels.value,
            self.pool.num_pages,
            self.pool.block_size,
            self.pool.storage.numel() * self.pool.storage.element_size() / 2**20,
            self.precision.reason,
        )

    # Adapters -------------------------------------------------------------------------------------

    def add_adapter(self, name: str, path: str | Path, validated: LoraAdapter | None = None) -> str:
        """Validate a PEFT LoRA folder and register it as ``name``; returns its content digest.

        Re-adding a name replaces the adapter (refused while unfinished requests use it); the new
        version never reuses KV computed with the old one, since its digest is part of every block hash.
        ``validated`` skips reading the folder again when :meth:`validate_adapter` already did.
        """
        return self.adapters.add(name, Path(path), validated).digest

    def validate_adapter(self, path: str | Path) -> LoraAdapter:
        """Read and check a PEFT LoRA folder against this model; touches no engine state (thread-safe)."""
        return load_lora_adapter(Path(path), self.model_config)

    def has_adapter(self, name: str) -> bool:
        """Whether an adapter is registered as ``name``."""
        return name in self.adapters.names()

    def remove_adapter(self, name: str) -> None:
        """Forget an adapter and free its pages; refused (AdapterBusyError) while requests use it."""
        self.adapters.remove(name)

    def pin_adapter(self, name: str, pinned: bool = True) -> None:
        """Keep an adapter resident in the pool (never evicted), or unpin it."""
        self.adapters.pin(name, pinned)

    # Requests -------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        adapter: str | None = None,
        tenant: str | None = None,
        grammar: "xgrammar.CompiledGrammar | None" = None,
    ) -> str:
        """Queue a request (text, or token ids) and return its id.

        ``tenant`` names whose share of the engine the request uses (the fair policy serves tenants,
        not requests, fairly); None puts it with every other request that names none. ``grammar`` is
        ``params.constraint`` compiled by ``self.grammars`` ahead of time (AsyncEngine does it in a worker
        thread); without it the constraint is compiled here, on the caller's thread.
        """
        entry = self.adapters.get(adapter) if adapter is not None else None
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.limits.check(prompt_ids, params, entry.layout.num_pages if entry is not None else None)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if params.constraint is not None and grammar is None:
            grammar = self.grammars.compile(params.constraint)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop),
            eos_token_ids=self._eos_ids,
            adapter=entry,
            tenant=DEFAULT_TENANT if tenant is None else tenant,
            fork_pending=params.n > 1,
            grammar=GrammarState(grammar) if params.constraint is not None else None,
        )
        if entry is not None:
            entry.num_requests += 1
        self._requests[request_id] = [seq]
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Stop every unfinished choice of a request now and free its pages; their last outputs (none if unknown)."""
        choices = self._requests.pop(request_id, [])
        outputs = []
        for seq in choices:
            if seq.finish_reason is None:
                self._finish(seq, FinishReason.ABORT)
                outputs.append(RequestOutput.of(seq, [], seq.detokenizer.flush(), request_finished=True))
        return outputs

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(seq, reason)
        if seq.adapter is not None:
            seq.adapter.num_requests -= 1

    def _request_finished(self, seq: Sequence) -> bool:
        """Whether every choice of ``seq``'s request has finished (the request is then forgotten)."""
        choices = self._requests.get(seq.request_id)
        if choices is None:
            return True
        if any(choice.finish_reason is None or choice.fork_pending for choice in choices):
            return False
        del self._requests[seq.request_id]
        return True

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """Give ``tenant`` ``weight`` times the service of a tenant of weight 1 (the default) under the fair policy.

        Takes effect from the next step; the FIFO policy ignores weights.
        """
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(f"a tenant's weight must be a positive number, got {weight!r} for {tenant!r}")
        self.scheduler.admission.set_weight(tenant, weight)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting or running (drive ``step()`` until this is False)."""
        return self.scheduler.num_unfinished > 0

    # The step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that got a token or finished.

        A failure is contained to the requests it belongs to: when the batched forward pass raises, each
        scheduled sequence runs again on its own, and only those that fail alone finish with reason
        "error" (and the error in their output); the others go on as if nothing happened. Running a
        chunk again is safe: it writes the same K/V into the same slots.
        """
        scheduled = self.scheduler.schedule()
        self._totals["preemptions"] += len(scheduled.preempted_ids)
        self.pool.copy_pages(self.kv.take_copies())
        failed: list[RequestOutput] = []
        try:
            result = self._run(scheduled.scheduled)
        except Exception:
            logger.exception("a step of %d sequences failed; running each on its own", len(scheduled.scheduled))
            scheduled, result, failed = self._run_each(scheduled)
        return failed + self._update(scheduled, result)

    def _run(self, items: tuple[ScheduledSeq, ...]) -> StepResult:
        """The forward pass and sampling: each sequence that reached its end gets one token (each choice, on a fork).

        A sequence verifying a proposal gets the proposed tokens its rows agree with, and one more.
        """
        if not items:
            return StepResult()
        batch = build_step_batch(items, self.pool, self.model_config, self.device, self.kernels)
        logits = self.model.forward(batch, self.pool)  # [num_sampled + num_scored, vocab]
        num_sampled = len(batch.sampled_seqs)
        rows, seqs, forks = fork_choices(batch.sampled_seqs, self.tokenizer)
        sampled_logits = logits[:num_sampled] if not forks else logits[rows]  # [num_choices, vocab]
        sampling = build_sampling_batch(seqs, self.model_config.vocab_size, self.device)
        states = generator_states(seqs)
        out = sample(sampled_logits, sampling, self.kernels)
        verified = accept(seqs, out.token_ids, out.logprobs)
        rewind_generators(states, verified)
        return StepResult(
            sampled=verified,
            scores=prompt_scores(batch, logits[num_sampled:]),
            forks=forks,
        )

    def _run_each(self, scheduled: SchedulerOutput) -> tuple[SchedulerOutput, StepResult, list[RequestOutput]]:
        """After a failed step: run every sequence alone; fail those that fail alone, keep the others' tokens."""
        kept: list[ScheduledSeq] = []
        result = StepResult()
        failed: list[RequestOutput] = []
        for item in scheduled.scheduled:
            try:
                alone = self._run((item,))
            except Exception as error:
                failed.append(self._fail(item.seq, error))
                continue
            result.sampled += alone.sampled
            result.scores += alone.scores
            result.forks += alone.forks
            kept.append(item)
        num_kept_tokens = sum(item.num_new_tokens for item in kept)
        return SchedulerOutput(tuple(kept), scheduled.preempted_ids, num_kept_tokens), result, failed

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """Finish ``seq`` with reason "error" and free its pages; its output carries the error for the logs."""
        logger.error("request %s failed in the engine", seq.request_id, exc_info=error)
        seq.fork_pending = False  # its choices will never be forked: the request ends with this one
        self._finish(seq, FinishReason.ERROR)
        return RequestOutput.of(
            seq, [], "", error=f"{type(error).__name__}: {error}", request_finished=self._request_finished(seq)
        )

    def _update(self, scheduled: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        for item in scheduled.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            self._totals["prefill"] += max(0, min(start + item.num_new_tokens, seq.num_prompt_tokens) - start)
        self.scheduler.update(scheduled)
        for seq, scores in result.scores:
            seq.prompt_logprobs.extend(scores)
            seq.prompt_logprobs_done = len(seq.prompt_logprobs) == seq.num_prompt_tokens
        for parent, children in result.forks:
            self._fork(parent, children)
        outputs = []
        for verified in result.sampled:
            seq = verified.seq
            if seq.index == 0 and seq.num_output_tokens == 0 and seq.num_preemptions == 0:
                self._totals["prompt"] += seq.num_prompt_tokens
                self._totals["cached"] += seq.num_cached_tokens
            if seq.params.max_tokens == 0:  # the prompt was only to be scored
                self._finish(seq, FinishReason.LENGTH)
                outputs.append(RequestOutput.of(seq, [], "", request_finished=self._request_finished(seq)))
                continue
            try:
                token_ids, delta = self._append(verified)
            except Exception as error:  # e.g. detokenizing or a stop check: only this request fails
                outputs.append(self._fail(seq, error))
                continue
            if seq.finish_reason is not None:
                self._finish(seq, seq.finish_reason)
            outputs.append(RequestOutput.of(seq, token_ids, delta, request_finished=self._request_finished(seq)))
        return outputs

    def _append(self, verified: Verified) -> tuple[list[int], str]:
        """Give a sequence its tokens from the step, in order, until one ends it; the tokens taken and their text.

        A speculating sequence's accepted proposal becomes computed KV; the blocks of the rest go back.
        """
        seq = verified.seq
        token_ids: list[int] = []
        delta = ""
        for token_id, logprob in zip(verified.token_ids, verified.logprobs, strict=True):
            self._totals["generated"] += 1
            if logprob is not None:
                seq.logprobs.append(logprob)
            delta += seq.append_token(token_id)
            token_ids.append(token_id)
            if seq.finish_reason is not None:
                break
        if verified.num_proposed:
            num_accepted = len(verified.token_ids) - 1
            self.speculator.record(seq, verified.num_proposed, num_accepted)
            if seq.finish_reason is None:
                self.scheduler.verified(seq, num_accepted)
        return token_ids, delta

    def _fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Start ``children`` from ``parent``'s computed prompt: its blocks shared, each choice on its own from now."""
        parent.fork_pending = False
        for child in children:
            self.kv.fork(parent, child)
            child.prompt_logprobs_done = parent.prompt_logprobs_done
            if child.adapter is not None:
                child.adapter.num_requests += 1
        self.scheduler.add_forked(parent, children)
        self._requests[parent.request_id] += children

    # Conveniences ---------------------------------------------------------------------------------

    def generate(
        self,
        prompts: SequenceOf[str | list[int]],
        params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        adapters: SequenceOf[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion together; the final outputs, prompt by prompt, each's n choices in order."""
        params = params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        adapters = list(adapters) if adapters is not None else [None] * len(prompts)
        if not len(params_list) == len(adapters) == len(prompts):
            raise RequestError("prompts, params and adapters must have the same length")
        request_ids = [
            self.add_request(prompt, p, adapter=a) for prompt, p, a in zip(prompts, params_list, adapters, strict=True)
        ]
        finals: dict[tuple[str, int], RequestOutput] = {}
        num_choices = sum(p.n for p in params_list)
        while len(finals) < num_choices:
            outputs = self.step()
            if not outputs and not self.scheduler.running:
                raise PoolExhaustedError(
                    f"{len(self.scheduler.admission)} request(s) cannot be admitted: their KV and adapters do not "
                    "fit next to the pinned adapters; unpin adapters or give the engine more memory"
                )
            for output in outputs:
                if output.finished:
                    finals[output.request_id, output.index] = output
        return [finals[rid, index] for rid, p in zip(request_ids, params_list, strict=True) for index in range(p.n)]

    def stats(self) -> EngineStats:
        """A snapshot of the pool, the queues and the counters."""
        pool = self.pool.stats()
        return EngineStats(
            num_pages=pool.num_pages,
            block_size=pool.block_size,
            page_bytes=pool.page_bytes,
            pages_by_owner=pool.pages_by_owner,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.admission),
            num_resident_adapters=self.adapters.num_resident,
            num_registered_adapters=len(self.adapters.names()),
            num_preemptions=self._totals["preemptions"],
            num_prompt_tokens=self._totals["prompt"],
            num_cached_prompt_tokens=self._totals["cached"],
            num_generated_tokens=self._totals["generated"],
            num_prefill_tokens=self._totals["prefill"],
            num_kv_blocks_allocated=self.kv.num_blocks_allocated,
            scheduling_policy=self.config.scheduling_policy,
            tenant_counters=self.scheduler.admission.counters(),
            running_adapters=_adapter_names(self.scheduler.running),
            waiting_adapters=_adapter_names(self.scheduler.admission),
            max_adapters=self.adapters.capacity(),
            dtype=dtype_name(self.precision.dtype),
            activation_dtype=dtype_name(self.precision.activation_dtype),
            kv_dtype=dtype_name(self.precision.kv_dtype),
            weight_format=self.precision.weight_format,
            precision_reason=self.precision.reason,
            bf16_gemm=self.precision.bf16_gemm or "",
            num_proposed_tokens=dict(self.speculator.stats.num_proposed) if self.speculator else {},
            num_accepted_tokens=dict(self.speculator.stats.num_accepted) if self.speculator else {},
        )


def _adapter_names(seqs: Iterable[Sequence]) -> list[str]:
    """The engine names of the adapters ``seqs`` use, sorted and each once (base-model sequences name none)."""
    return sorted({seq.adapter.name for seq in seqs if seq.adapter is not None})
