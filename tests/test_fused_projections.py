"""The fused-projection pass: storage layouts and the rewritten graph compute what the model computes."""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import models
from autopar.compiler.capture import capture
from autopar.core.layout import Interleave, from_storage, to_storage
from autopar.passes.fused_projections import interleave_fused_projections


@given(blocks=st.lists(st.integers(1, 4), min_size=2, max_size=4), n=st.sampled_from([1, 2, 3]),
       dim=st.sampled_from([0, 1]))
def test_storage_round_trip_and_rank_chunks(blocks: list[int], n: int, dim: int) -> None:
    """Rank r's chunk of the stored tensor is the r-th chunk of every block, in block order."""
    sizes = tuple(b * n for b in blocks)
    lay = Interleave(dim, sizes, n)
    shape = [5, 5]
    shape[dim] = sum(sizes)
    t = torch.randn(shape, dtype=torch.float64)
    stored = to_storage(t, lay)
    assert torch.equal(from_storage(stored, lay), t)
    for r, chunk in enumerate(stored.chunk(n, dim)):
        expect = torch.cat([block.chunk(n, dim)[r] for block in t.split(list(sizes), dim)], dim)
        assert torch.equal(chunk, expect)


def test_every_way_of_cutting_is_found_and_the_graph_is_unchanged_in_value() -> None:
    """Slices of unequal widths (q|k|v with fewer kv heads) and chunk (gate|up) are both rewritten."""
    model = models.fused_slice(layers=1)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    cap = capture(model, (ids,))
    layouts = interleave_fused_projections(cap, 2)
    assert layouts["blocks.0.qkv.weight"] == Interleave(0, (32, 16, 16), 2)
    assert layouts["blocks.0.qkv.bias"] == Interleave(0, (32, 16, 16), 2)
    assert layouts["blocks.0.gate_up.weight"] == Interleave(0, (64, 64), 2)
    cap.gm.graph.lint()
    state = {n: (to_storage(p.data, layouts[n]) if n in layouts else p.data) for n, p in model.named_parameters()}
    state |= dict(model.named_buffers())
    assert torch.equal(cap.run(state, [ids]), model(ids))
