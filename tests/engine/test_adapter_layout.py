"""Where an adapter's rows sit in its pages (engine/adapters/adapter_layout.py): each row whole in one page, at a
multiple of ROW_ALIGN elements, so the Triton SGMV kernels may read every row with 16-byte loads."""

import itertools
from types import SimpleNamespace

import pytest

from engine.adapters.adapter_layout import ROW_ALIGN, pages_for_rank, plan_layout, row_alignment
from engine.adapters.lora_config import PROJECTIONS, projection_shapes
from engine.config import ModelConfig

# A model whose widths are not multiples of 16: hidden 40, q 40, k/v 20, MLP 72.
ODD_MODEL = ModelConfig.from_dict(
    {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 40,
        "intermediate_size": 72,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 10,
        "max_position_embeddings": 128,
    }
)


def _adapter(rank: int) -> SimpleNamespace:
    """What the layout reads of an adapter: its target modules and their ranks."""
    return SimpleNamespace(modules=PROJECTIONS, ranks=dict.fromkeys(PROJECTIONS, rank))


@pytest.mark.parametrize("page_elems", [200, 256, 1000])
@pytest.mark.parametrize("rank", [1, 3, 8])
def test_every_row_starts_aligned_and_lies_whole_in_its_page(rank: int, page_elems: int) -> None:
    layout = plan_layout(_adapter(rank), ODD_MODEL, page_elems)
    shapes = projection_shapes(ODD_MODEL)
    dims = [shapes[group.module][group.kind == "b"] for group in layout.groups for _ in range(group.num_rows)]
    places = list(zip(layout.row_pages, layout.row_offsets, dims, strict=True))
    assert all(offset % ROW_ALIGN == 0 and offset + dim <= page_elems for _, offset, dim in places)
    for (page, offset, dim), (next_page, next_offset, _) in itertools.pairwise(places):
        assert (next_page, next_offset) >= (page, offset + dim)  # in order, never overlapping
    assert pages_for_rank(ODD_MODEL, rank, page_elems) == layout.num_pages


def test_row_addresses_are_multiples_of_the_pool_alignment() -> None:
    layout = plan_layout(_adapter(3), ODD_MODEL, 200)
    for page_elems, align in [(200, 8), (256, 16), (6144, 16), (30, 2)]:
        assert row_alignment(page_elems) == align
    page_ids = [(7 * page) % 23 for page in range(layout.num_pages)]  # the pool's pages, in any order
    addresses = layout.row_addr(page_ids, ODD_MODEL.num_layers, 200).tolist()
    assert all(address % row_alignment(200) == 0 for address in addresses)
