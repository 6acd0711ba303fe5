"""Model code written in ways other than the zoo's, under tensor parallelism and pipelines.

Each case trained silently wrong or failed without a clear error: a write through a view of a sharded value
(``h[..., :5] = 0``, a shift ``z[..., 1:] = h[..., :-1]``), a fused projection cut per head after a view
(GPT-NeoX's q|k|v), a module the forward never calls on a pipeline.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import models
from autopar import Mesh, parallelize
from autopar.compiler.capture import capture
from autopar.core.errors import UnsupportedError
from autopar.passes.fused_projections import interleave_fused_projections
from autopar.passes.inplace_views import check_writes
from autopar.testing import assert_equivalent

D, H = 8, 16
X = torch.randn(4, 6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
Y = torch.randn(4, 6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


class ZeroedColumns(nn.Module):
    """An MLP whose hidden columns 0-4 are zeroed in place: a write across tp's shards of the hidden dim."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x)).clone()
        h[..., :5] = 0.0
        return self.down(h)


class ShiftedColumns(ZeroedColumns):
    """The hidden columns shifted by one into a zero tensor (``z[..., 1:] = h[..., :-1]``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        z = torch.zeros_like(h)
        z[..., 1:] = h[..., :-1]
        return self.down(z)


class ReadBeforeAndAfter(ZeroedColumns):
    """The hidden value read by one projection before columns 0-4 are zeroed and by another after."""

    def __init__(self) -> None:
        super().__init__()
        self.other = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x)).clone()
        before = self.down(h + 1.0)
        h[..., :5] = 0.0
        return before + self.other(h)


class HeadwiseQKV(nn.Module):
    """GPT-NeoX's fused projection: viewed as (B, S, heads, 3 * head_dim), then cut into q, k, v per head."""

    def __init__(self, heads: int = 2, head_dim: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = nn.Linear(D, 3 * heads * head_dim)
        self.o = nn.Linear(heads * head_dim, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, self.heads, 3 * self.head_dim).split(self.head_dim, dim=-1)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


class WithUnusedModule(nn.Module):
    """Four layers and a module that forward never calls (a head kept for another task)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
        self.unused = nn.Linear(D, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


def _make(cls: type[nn.Module]) -> nn.Module:
    """``cls`` seeded, in float64 (the same model on every call)."""
    torch.manual_seed(0)
    return cls().to(torch.float64)


def make_zeroed() -> nn.Module:
    return _make(ZeroedColumns)


def make_shifted() -> nn.Module:
    return _make(ShiftedColumns)


def make_read_twice() -> nn.Module:
    return _make(ReadBeforeAndAfter)


@pytest.mark.parametrize("make", [make_zeroed, make_shifted, make_read_twice])
def test_a_write_through_a_view_of_a_sharded_value_is_exact(launcher, make) -> None:
    """Nothing is converted between the written value and the write: an all-gather before the slice made the
    write land on the gathered copy (the first trained wrong; the second's forward after training, whose plan
    differs, returned the zero tensor unwritten). The third's shards of ``h``, cut for the read before the
    write, are cut again for the read after it, not reused stale."""
    assert_equivalent(make, Mesh(tp=2), (X,), Y, models.mse, models.adamw, steps=2, rtol=1e-9, atol=1e-10,
                      launcher=launcher)


def test_a_write_that_would_reach_a_copy_is_refused_by_name() -> None:
    """Where a lowered graph still converts a value between it and a write into its view, the write is named."""
    graph = fx.Graph()
    h = graph.placeholder("h")
    gathered = graph.call_function(torch.ops.autopar.all_gather.default, (h, "tp", 2))
    part = graph.call_function(torch.ops.aten.slice.Tensor, (gathered, 2, 0, 5))
    graph.call_function(torch.ops.aten.fill_.Scalar, (part, 0.0))
    graph.output(h)
    with pytest.raises(UnsupportedError, match=r"fill__scalar writes in place into a view of h.*all_gather.*out of"):
        check_writes(fx.GraphModule(torch.nn.Module(), graph), 2)


def test_a_projection_cut_per_head_after_a_view_is_not_reordered() -> None:
    """The split cuts the view's last dim (3 * head_dim per head), not the weight's columns: the weight stays
    as it is (re-ordering it by those blocks failed at the first step: 'split_with_sizes expects split_sizes
    to sum exactly to 24'), and a plain shard of its rows hands each rank its heads."""
    cap = capture(_make(HeadwiseQKV), (X,))
    assert interleave_fused_projections(cap, 2) == {}
    pm = parallelize(_make(HeadwiseQKV), Mesh(tp=2), loss_fn=models.mse, optimizer=models.adamw)
    assert pm.compile((X,), {}, Y).placements["qkv.weight"] == torch.distributed.tensor.Shard(0)


def test_a_module_forward_never_calls_is_held_by_a_pipeline_stage() -> None:
    """Its parameters were in no stage: no rank held them, and ``state_dict`` returned uninitialized memory."""
    pm = parallelize(_make(WithUnusedModule), Mesh(pp=2), loss_fn=models.mse, optimizer=models.adamw,
                     microbatches=2)
    program = pm.compile((X,), {}, Y)
    held = {name for stages in program.graphs.by_tp for st in stages for name in st.params}
    assert {"unused.weight", "unused.bias"} <= held
