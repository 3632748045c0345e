"""The engine: requests in, tokens out, one step at a time.

:class:`Engine` builds the model, the page pool and the scheduler, registers adapters, and checks and
queues requests; its :class:`~engine.step.step_runner.StepRunner` runs each step (schedule, run, update).
"""

import itertools
import logging
import math
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer

from engine.adapters.adapter_cache import AdapterCache
from engine.adapters.lora_adapter import LoraAdapter, load_lora_adapter
from engine.config import EngineConfig, ModelConfig
from engine.errors import ConfigError, PoolExhaustedError, RequestError
from engine.memory.host_memory import keep_large_buffers_in_heap
from engine.memory.kv_cache_manager import KVCacheManager
from engine.memory.page_pool import make_pool
from engine.modeling.model import LlamaModel
from engine.modeling.precision import dtype_name
from engine.modeling.weights import load_weights
from engine.output.detokenizer import IncrementalDetokenizer
from engine.output.outputs import EngineStats, RequestOutput
from engine.output.token_bytes import TokenBytes
from engine.sampling.grammar import GrammarCompiler, GrammarState
from engine.sampling.sampling_params import SamplingParams
from engine.scheduling.fair_queue import FairQueue
from engine.scheduling.request_limits import RequestLimits
from engine.scheduling.request_queue import FifoQueue, RequestQueue
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sequence import DEFAULT_TENANT, Sequence
from engine.speculative.speculation import Speculator
from engine.step.decode_graphs import DecodeGraphs
from engine.step.step_runner import StepRunner
from loraplex_kernels.backend import KernelBackend

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
        decode_graphs = self._decode_graphs()  # its scratch page, taken now, is no request's
        self.limits = RequestLimits(
            self.model_config.vocab_size,
            config.max_num_seqs,
            self.max_model_len,
            self.pool.num_pages - (1 if decode_graphs is not None else 0),
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
            config.step_token_budget(self.device),
            QUEUE_BY_POLICY[config.scheduling_policy](),
            self.speculator,
        )
        self._eos_ids = frozenset(self.model_config.eos_token_ids) | frozenset(
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, sorted(self._eos_ids))
        self._runner = StepRunner(
            model=self.model,
            decode_graphs=decode_graphs,
            model_config=self.model_config,
            pool=self.pool,
            kv=self.kv,
            scheduler=self.scheduler,
            speculator=self.speculator,
            tokenizer=self.tokenizer,
            device=self.device,
            kernels=self.kernels,
            launch_ahead=self.device.type == "cuda" if config.launch_ahead is None else config.launch_ahead,
        )
        self._ids = itertools.count()
        logger.info(
            "engine ready: %s on %s with the %s kernels, %d pages of %d tokens (%.0f MiB%s); %s",
            folder.name,
            self.device,
            self.kernels.value,
            self.pool.num_pages,
            self.pool.block_size,
            self.pool.storage.numel() * self.pool.storage.element_size() / 2**20,
            ", advised for huge pages" if self.pool.huge_pages else "",
            self.precision.reason,
        )

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of decode steps where the engine runs the Triton kernels on CUDA and the config wants them."""
        if not (self.config.cuda_graphs and self.device.type == "cuda" and self.kernels is KernelBackend.TRITON):
            return None
        return DecodeGraphs(self.model, self.pool, self.config.max_num_seqs, self.max_model_len, capture=True)

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
        if self._runner.has_request(request_id):
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
        self._runner.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Stop every unfinished choice of a request now and free its pages; their last outputs (none if unknown)."""
        return self._runner.abort(request_id)

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

        A failure is contained to the requests it belongs to: only the sequences that fail on their own
        finish with reason "error" (and the error in their output); the others go on as if nothing
        happened (:meth:`StepRunner.step` says how).
        """
        return self._runner.step()

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
            num_preemptions=self._runner.totals["preemptions"],
            num_prompt_tokens=self._runner.totals["prompt"],
            num_cached_prompt_tokens=self._runner.totals["cached"],
            num_generated_tokens=self._runner.totals["generated"],
            num_prefill_tokens=self._runner.totals["prefill"],
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
            num_steps_launched_ahead=self._runner.ahead.counts["taken"] if self._runner.ahead else 0,
            num_passes_dropped=self._runner.ahead.counts["dropped"] if self._runner.ahead else 0,
        )


def _adapter_names(seqs: Iterable[Sequence]) -> list[str]:
    """The engine names of the adapters ``seqs`` use, sorted and each once (base-model sequences name none)."""
    return sorted({seq.adapter.name for seq in seqs if seq.adapter is not None})
