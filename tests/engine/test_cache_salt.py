"""The prefix cache is shared only among requests of one cache salt (the gateway salts with the tenant)."""

import random
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.errors import RequestError
from tests.engine.conftest import make_engine

NUM_PROMPT_TOKENS = 64  # 4 full blocks of 16: 3 can be served from the cache (the last token is recomputed)
NUM_CACHEABLE_TOKENS = 48


def _params(cache_salt: str | None, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=n, cache_salt=cache_salt)


def test_requests_share_cached_blocks_only_with_their_own_salt(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    rng = random.Random(7)
    prompt = [rng.randrange(3, engine.model_config.vocab_size) for _ in range(NUM_PROMPT_TOKENS)]
    acme = engine.generate([prompt], _params("tenant-acme"))[0]
    umbrella = engine.generate([prompt], _params("tenant-umbrella"))[0]
    unsalted = engine.generate([prompt], _params(None))[0]
    acme_again = engine.generate([prompt], _params("tenant-acme"))[0]
    unsalted_again = engine.generate([prompt], _params(None))[0]
    assert [acme.num_cached_tokens, umbrella.num_cached_tokens, unsalted.num_cached_tokens] == [0, 0, 0]
    assert acme_again.num_cached_tokens == unsalted_again.num_cached_tokens == NUM_CACHEABLE_TOKENS
    assert acme.token_ids == umbrella.token_ids == unsalted.token_ids == acme_again.token_ids


def test_the_choices_of_a_salted_request_share_its_prompt_and_cache(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    rng = random.Random(8)
    prompt = [rng.randrange(3, engine.model_config.vocab_size) for _ in range(NUM_PROMPT_TOKENS)]
    engine.generate([prompt], _params("tenant-acme"))
    outputs = engine.generate([prompt], _params("tenant-acme", n=3))
    assert [output.num_cached_tokens for output in outputs] == [NUM_CACHEABLE_TOKENS] * 3


@pytest.mark.parametrize("salt", ["", "x" * 257])
def test_a_salt_is_refused_empty_or_too_long(salt: str) -> None:
    with pytest.raises(RequestError, match="cache_salt"):
        _params(salt)
