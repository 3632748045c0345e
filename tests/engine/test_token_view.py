"""TokenView: an output's tokens so far, as a snapshot of the sequence's growing list without a copy."""

import operator
import pickle

import pytest

from engine import SamplingParams
from engine.output.token_view import TokenView
from tests.engine.conftest import make_engine


def test_a_view_keeps_its_bounds_while_the_list_grows():
    tokens = [1, 2, 3, 10, 11]  # a prompt of 3, two output tokens
    view = TokenView(tokens, 3, 5)
    tokens += [12, 13]

    assert len(view) == 2 and list(view) == [10, 11] and view == [10, 11] and operator.eq([10, 11], view)
    assert view == (10, 11) and view == TokenView([0, 10, 11], 1, 3)
    assert view != [10, 11, 12] and view != [10] and view != [10, 12] and view != "ab"
    assert view[0] == 10 and view[-1] == 11 and view[1:] == [11] and view[5:] == [] and view[::-1] == [11, 10]
    assert view[1:0] == [] and view[-5:1] == [10]
    with pytest.raises(IndexError):
        view[2]
    with pytest.raises(IndexError):
        view[-3]
    assert operator.add([0], view) == [0, 10, 11] and operator.add(view, [12]) == [10, 11, 12]
    assert repr(view) == "[10, 11]" and 11 in view and view.index(11) == 1
    restored = pickle.loads(pickle.dumps(view))
    assert type(restored) is list and restored == [10, 11]
    with pytest.raises(TypeError):
        hash(view)
    with pytest.raises(ValueError):
        TokenView(tokens, 3, 8)


def test_each_streamed_output_holds_the_tokens_of_its_step(tiny_llama):
    engine = make_engine(tiny_llama)
    request_id = engine.add_request([1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [output for output in engine.step() if output.request_id == request_id]

    final = list(outputs[-1].token_ids)
    assert len(final) == 6
    assert [list(output.token_ids) for output in outputs] == [final[: i + 1] for i in range(6)]
    assert [output.delta_token_ids for output in outputs] == [[token] for token in final]
