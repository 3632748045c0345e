"""What a request may ask of an engine: token ids in the vocabulary, ``n`` within the batch, the context and
the page pool big enough for its whole length. Each refusal is a RequestError saying what to change."""

from dataclasses import dataclass

from engine.errors import RequestError
from engine.sampling.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """One engine's bounds on a request, fixed when the engine is built."""

    vocab_size: int
    max_num_seqs: int
    max_model_len: int  # tokens of context
    num_pages: int  # pages of the pool
    block_size: int  # tokens of one KV page

    def check(self, prompt_ids: list[int], params: SamplingParams, adapter_pages: int | None) -> None:
        """Raise RequestError unless the request fits; ``adapter_pages`` is its adapter's pages (None: no adapter)."""
        if not prompt_ids:
            raise RequestError("the prompt is empty; send at least one token")
        if any(not 0 <= token < self.vocab_size for token in prompt_ids):
            raise RequestError(f"prompt token ids must be within [0, {self.vocab_size}), the model's vocabulary")
        if any(not 0 <= token < self.vocab_size for token, _ in params.logit_bias):
            raise RequestError(f"logit_bias token ids must be within [0, {self.vocab_size}), the model's vocabulary")
        if params.n > self.max_num_seqs:
            raise RequestError(f"n ({params.n}) exceeds the engine's max_num_seqs ({self.max_num_seqs})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens"
            )
        kv_pages = -(-total // self.block_size)
        if kv_pages + (adapter_pages or 0) > self.num_pages:
            raise RequestError(
                f"a request of {total} tokens{' and its adapter' if adapter_pages is not None else ''} cannot fit "
                f"the page pool ({self.num_pages} pages of {self.block_size} tokens); lower max_tokens or give the "
                "engine more memory"
            )
