"""Each bound a request must keep, and the request just inside it, on small limits (no model needed)."""

import pytest

from engine import RequestError, SamplingParams
from engine.scheduling.request_limits import RequestLimits

LIMITS = RequestLimits(vocab_size=100, max_num_seqs=4, max_model_len=64, num_pages=5, block_size=16)


@pytest.mark.parametrize(
    ("prompt_ids", "params", "adapter_pages", "match"),
    [
        ([], SamplingParams(), None, "prompt is empty"),
        ([1, 100], SamplingParams(), None, r"prompt token ids must be within \[0, 100\)"),
        ([1, -1], SamplingParams(), None, r"prompt token ids must be within \[0, 100\)"),
        ([1], SamplingParams(logit_bias={100: 1.0}), None, r"logit_bias token ids must be within \[0, 100\)"),
        ([1], SamplingParams(n=5), None, r"n \(5\) exceeds the engine's max_num_seqs \(4\)"),
        ([1] * 60, SamplingParams(max_tokens=5), None, r"prompt \(60 tokens\) plus max_tokens \(5\) exceeds"),
        ([1] * 40, SamplingParams(max_tokens=20), 2, "a request of 60 tokens and its adapter cannot fit"),
    ],
)
def test_a_request_past_a_bound_is_refused_with_what_to_change(prompt_ids, params, adapter_pages, match) -> None:
    with pytest.raises(RequestError, match=match):
        LIMITS.check(prompt_ids, params, adapter_pages)


def test_requests_at_the_bounds_pass() -> None:
    LIMITS.check([99] * 48, SamplingParams(max_tokens=16, n=4, logit_bias={99: -1.0}), None)  # 64 tokens, 4 pages
    LIMITS.check([1] * 40, SamplingParams(max_tokens=8), 2)  # 3 K/V pages + 2 adapter pages = the pool's 5
