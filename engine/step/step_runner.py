"""One engine step (schedule, run, update), and the unfinished requests it steps.

The run is the forward pass over the scheduled sequences and the sampling of their next tokens; the
update applies what it produced: prompt logprobs recorded, forked choices started, tokens appended
(detokenized, checked for stops), and the sequences that ended finished. The runner keeps the choices of
every unfinished request because a step is what forks and finishes them: a request is done, and
forgotten, once its last choice finishes.
"""

import logging
from dataclasses import replace

import torch
from transformers import PreTrainedTokenizerBase

from engine.adapters.lora_batch import LoraStepMemo
from engine.config import ModelConfig
from engine.memory.host_to_device import move_to_device
from engine.memory.kv_cache_manager import KVCacheManager
from engine.memory.page_pool import PagePool
from engine.modeling.model import LlamaModel
from engine.output.outputs import RequestOutput
from engine.sampling.sampler import draw
from engine.sampling.sampling_batch import build_sampling_batch
from engine.scheduling.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.scheduling.sequence import FinishReason, Sequence
from engine.speculative.speculation import Speculator
from engine.speculative.verification import Verified, accept, generator_states, rewind_generators
from engine.step.decode_graphs import DecodeGraphs
from engine.step.launch_ahead import LaunchAhead
from engine.step.step_batch import HOST, StepBatch, build_step_batch
from engine.step.step_result import StepResult, fork_choices, prompt_scores
from loraplex_kernels.backend import KernelBackend

logger = logging.getLogger(__name__)


class StepRunner:
    """Steps the scheduled sequences of the engine's unfinished requests and applies each step's results.

    ``totals`` counts, over the engine's life, the preempted sequences ("preemptions"), the prompt tokens of
    the requests that started ("prompt") and how many of those came from the prefix cache ("cached"), the
    generated tokens ("generated") and the prompt tokens computed ("prefill").
    """

    def __init__(
        self,
        *,
        model: LlamaModel,
        decode_graphs: DecodeGraphs | None = None,
        model_config: ModelConfig,
        pool: PagePool,
        kv: KVCacheManager,
        scheduler: Scheduler,
        speculator: Speculator | None,
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        kernels: KernelBackend,
        launch_ahead: bool = False,
    ) -> None:
        self.model = model
        self.decode_graphs = decode_graphs
        self.model_config = model_config
        self.pool = pool
        self.kv = kv
        self.scheduler = scheduler
        self.speculator = speculator
        self.tokenizer = tokenizer
        self.device = device
        self.kernels = kernels
        self.lora_memo = LoraStepMemo()
        self.ahead = (
            LaunchAhead(
                forward=self._forward,
                kv=kv,
                pool=pool,
                model_config=model_config,
                kernels=kernels,
                lora_memo=self.lora_memo,
            )
            if launch_ahead
            else None
        )
        self._requests: dict[str, list[Sequence]] = {}  # every choice of each unfinished request
        self.totals = {"preemptions": 0, "prompt": 0, "cached": 0, "generated": 0, "prefill": 0}

    # Requests -------------------------------------------------------------------------------------

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` names an unfinished request."""
        return request_id in self._requests

    def add(self, seq: Sequence) -> None:
        """Take a new request as its first choice ``seq`` and queue it for the scheduler."""
        if seq.adapter is not None:
            seq.adapter.num_requests += 1
        self._requests[seq.request_id] = [seq]
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> list[RequestOutput]:
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
        if seq.finish_reason is None:  # one of its choices goes on (what most outputs of a step are asked)
            return False
        if any(choice.finish_reason is None or choice.fork_pending for choice in choices):
            return False
        del self._requests[seq.request_id]
        return True

    # The step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run and update one step; an output for every request that got a token or finished.

        A failure is contained to the requests it belongs to: when the batched forward pass raises, each
        scheduled sequence runs again on its own, and only those that fail alone finish with reason
        "error" (and the error in their output); the others go on as if nothing happened. Running a
        chunk again is safe: it writes the same K/V into the same slots.
        """
        scheduled = self.scheduler.schedule()
        self.totals["preemptions"] += len(scheduled.preempted_ids)
        self.pool.copy_pages(self.kv.take_copies())
        failed: list[RequestOutput] = []
        try:
            result = self._run(scheduled.scheduled)
        except Exception:
            logger.exception("a step of %d sequences failed; running each on its own", len(scheduled.scheduled))
            scheduled, result, failed = self._run_each(scheduled)
        return failed + self._update(scheduled, result)

    def _run(self, items: tuple[ScheduledSeq, ...], launch_ahead: bool = True) -> StepResult:
        """The forward pass and sampling: each sequence that reached its end gets one token (each choice, on a fork).

        A sequence verifying a proposal gets the proposed tokens its rows agree with, and one more. With the
        runner's :class:`LaunchAhead`, the rows that the pass the step before launched ran take its logits and the
        other items run in a forward pass of their own; and (``launch_ahead``) the next pass is launched as soon as
        this step's tokens are drawn.
        """
        if not items:
            return StepResult()
        taken = self.ahead.take(items) if self.ahead is not None else None
        rest = items if taken is None else taken.rest
        if taken is not None and rest:  # the pass's logits may be a graph's output, which the rest may replay
            taken = replace(taken, logits=taken.logits.clone())  # [num_taken, vocab]
        batch = (
            build_step_batch(rest, self.pool, self.model_config, HOST, self.kernels, self.lora_memo) if rest else None
        )
        logits = self._forward(batch) if batch is not None else None  # [num_rest_sampled + num_scored, vocab]
        num_rest = len(batch.sampled_seqs) if batch is not None else 0
        if taken is None:
            sampled_seqs, step_logits = batch.sampled_seqs, logits[:num_rest]  # [num_sampled, vocab]
        elif not num_rest:
            sampled_seqs, step_logits = taken.seqs, taken.logits
        else:  # the pass's rows, then the step's own
            sampled_seqs = taken.seqs + batch.sampled_seqs
            step_logits = torch.cat([taken.logits, logits[:num_rest]])  # [num_sampled, vocab]
        rows, seqs, forks = fork_choices(sampled_seqs, self.tokenizer)
        sampled_logits = step_logits if not forks else step_logits[rows]  # [num_choices, vocab]
        sampling = build_sampling_batch(seqs, self.model_config.vocab_size, self.device)
        states = generator_states(seqs)
        drawn = draw(sampled_logits, sampling, self.kernels)
        if self.ahead is not None and launch_ahead and not forks and (batch is None or not batch.scored):
            self.ahead.launch(seqs, drawn.token_ids)  # not after forks (new choices) or prompt scores (read later)
        out = drawn.read()
        verified = accept(seqs, out.token_ids, out.logprobs)
        rewind_generators(states, verified)
        return StepResult(
            sampled=verified,
            scores=prompt_scores(batch, logits[num_rest:]) if batch is not None else [],
            forks=forks,
        )

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        """The logits of ``batch`` (built on the host): its bucket's CUDA graph where one takes it, else eager."""
        if self.decode_graphs is not None and self.decode_graphs.fits(batch):
            return self.decode_graphs.forward(batch)  # [num_sampled, vocab]
        batch = move_to_device(batch, self.device)  # the step's tensors in one copy
        return self.model.forward(batch, self.pool)  # [num_sampled + num_scored, vocab]

    def _run_each(self, scheduled: SchedulerOutput) -> tuple[SchedulerOutput, StepResult, list[RequestOutput]]:
        """After a failed step: run every sequence alone; fail those that fail alone, keep the others' tokens."""
        if self.ahead is not None:
            self.ahead.drop()
        kept: list[ScheduledSeq] = []
        result = StepResult()
        failed: list[RequestOutput] = []
        for item in scheduled.scheduled:
            try:
                alone = self._run((item,), launch_ahead=False)
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
        """Apply a step's result to its sequences; an output for each sampled sequence, in the result's order."""
        num_prefill = 0
        for item in scheduled.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            num_prefill += max(0, min(start + item.num_new_tokens, seq.num_prompt_tokens) - start)
        self.totals["prefill"] += num_prefill
        self.scheduler.update(scheduled)
        for seq, scores in result.scores:
            seq.prompt_logprobs.extend(scores)
            seq.prompt_logprobs_done = len(seq.prompt_logprobs) == seq.num_prompt_tokens
        for parent, children in result.forks:
            self._fork(parent, children)
        outputs = []
        num_generated = 0
        for verified in result.sampled:
            seq = verified.seq
            if seq.index == 0 and seq.num_output_tokens == 0 and seq.num_preemptions == 0:
                self.totals["prompt"] += seq.num_prompt_tokens
                self.totals["cached"] += seq.num_cached_tokens
            if seq.params.max_tokens == 0:  # the prompt was only to be scored
                self._finish(seq, FinishReason.LENGTH)
                outputs.append(RequestOutput.of(seq, [], "", request_finished=self._request_finished(seq)))
                continue
            try:
                token_ids, delta = self._append(verified)
            except Exception as error:  # e.g. detokenizing or a stop check: only this request fails
                outputs.append(self._fail(seq, error))
                continue
            num_generated += len(token_ids)
            if seq.finish_reason is not None:
                self._finish(seq, seq.finish_reason)
            outputs.append(RequestOutput.of(seq, token_ids, delta, request_finished=self._request_finished(seq)))
        self.totals["generated"] += num_generated
        return outputs

    def _append(self, verified: Verified) -> tuple[list[int], str]:
        """Give a sequence its tokens from the step, in order, until one ends it; the tokens taken and their text.

        A speculating sequence's accepted proposal becomes computed KV; the blocks of the rest go back.
        """
        seq = verified.seq
        if not verified.num_proposed:  # one token, most rows of a step
            [token_id], [logprob] = verified.token_ids, verified.logprobs
            if logprob is not None:
                seq.logprobs.append(logprob)
            return verified.token_ids, seq.append_token(token_id)
        token_ids: list[int] = []
        delta = ""
        for token_id, logprob in zip(verified.token_ids, verified.logprobs, strict=True):
            if logprob is not None:
                seq.logprobs.append(logprob)
            delta += seq.append_token(token_id)
            token_ids.append(token_id)
            if seq.finish_reason is not None:
                break
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
