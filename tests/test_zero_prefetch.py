"""ZeRO-3's backward overlaps its collectives with compute, as FSDP2's does, read from ``pm.timeline(layers=True)``.

For layers L below L+1 (backward reaches L+1 first): layer L's re-gather is issued while L+1's backward
computes (``zero_prefetch`` layers ahead), and L's backward starts before L+1's gradient reduce-scatter is
waited for (that wait comes when L's own gradient is reduced, or at the end of the step): one reduction is in
flight at a time. The same holds for recomputed layers, whose backward begins with their recomputation.
"""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh, parallelize

LAYERS = 4
IDS = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(1))


def _events(prefetch: int, microbatches: int, recompute: str = "none") -> tuple[list, list]:
    """The last step's ``pm.timeline(layers=True)`` and ``pm.timeline()``."""
    torch.manual_seed(0)
    pm = parallelize(models.gpt2(layers=LAYERS, d=32), Mesh(dp=2), loss_fn=models.lm_loss, optimizer=models.sgd,
                     zero=3, zero_prefetch=prefetch, microbatches=microbatches, recompute=recompute)
    for _ in range(2):
        pm.step(IDS, target=IDS)
    if recompute != "none":  # every block, the last one too, is recomputed
        assert {la for la, mode in pm.plan.recompute.modes if mode == recompute} == \
            {f"transformer.h.{i}" for i in range(LAYERS)}, pm.plan.recompute.modes
    return pm.timeline(layers=True), pm.timeline()


def _spans(events: list[tuple[str, float, float]], microbatch: int) -> dict[str, tuple[float, float]]:
    """``"<what> <block index>" -> (start, end)`` of the transformer blocks' backward events of one microbatch
    (the ``microbatch``-th backward of each block)."""
    seen: dict[str, int] = {}
    out = {}
    for what, start, end in events:
        kind, _, group = what.partition(" ")
        if kind in ("regather", "backward", "reduce_scatter") and group.startswith("transformer.h."):
            key = f"{kind} {group.rsplit('.', 1)[1]}"
            if seen.setdefault(key, 0) == microbatch:
                out[key] = (start, end)
            seen[key] += 1
    return out


def _check(events: list[tuple[str, float, float]], prefetch: int, microbatch: int) -> None:
    reductions = [(what, start, end) for what, start, end in events if what.startswith("reduce_scatter ")]
    for (first, _, done), (then, issued, _) in zip(reductions, reductions[1:]):
        assert done < issued, f"{first} still in flight when {then} was issued"  # one flat gradient at a time
    spans = _spans(events, microbatch)
    assert len(spans) == 3 * LAYERS, sorted(spans)
    for upper in range(LAYERS - 1, 0, -1):
        lower = upper - 1
        issued, computed = spans[f"regather {lower}"][0], spans[f"backward {upper}"][1]
        if prefetch:
            assert issued < computed, f"block {lower}'s gather issued after block {upper}'s backward ended"
        else:
            assert issued > computed, f"zero_prefetch=0 prefetched block {lower}"
        started, reduced = spans[f"backward {lower}"][0], spans[f"reduce_scatter {upper}"][1]
        assert started < reduced, f"block {lower}'s backward waited for block {upper}'s reduce-scatter"
        if prefetch >= 2 and lower > 0:
            assert spans[f"regather {lower - 1}"][0] < computed, f"block {lower - 1} not prefetched two ahead"


def _runs() -> dict:
    runs = {(p, m): _events(p, m) for p, m in ((0, 1), (1, 1), (2, 1), (1, 2))}
    return runs | {(p, "full"): _events(p, 1, "full") for p in (0, 1, 2)}


@pytest.fixture(scope="module")
def runs(launcher) -> list[dict]:
    return launcher(_runs, 2)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_backward_gathers_ahead_and_does_not_wait_for_the_previous_reduction(runs, prefetch: int) -> None:
    for events, _ in (r[prefetch, 1] for r in runs):
        _check(events, prefetch, 0)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_recomputed_layers_are_gathered_ahead_too(runs, prefetch: int) -> None:
    """Under full recomputation each block's backward begins with its recomputation, which gathers it again:
    that gather is prefetched while the block above computes, as without recomputation."""
    for events, _ in (r[prefetch, "full"] for r in runs):
        _check(events, prefetch, 0)


def test_every_microbatch_overlaps(runs) -> None:
    for events, _ in (r[1, 2] for r in runs):
        for microbatch in (0, 1):
            _check(events, 1, microbatch)


def test_the_timeline_orders_zero_events_among_the_actions(runs) -> None:
    """Layer events fall inside the step's actions: the first layer's gather in UNSHARD (started before the
    graph runs), the other forward gathers in F, backward's in B, and the last reductions before the optimizer."""
    events, actions_only = runs[0][1, 1]
    actions = {what: (start, end) for what, start, end in events if " " not in what}
    forward, backward, optimizer = actions["0F0"], actions["0B0"], actions["OPTIMIZER"]
    unshard = actions["0UNSHARD"]
    first = next((what, start) for what, start, _ in events if what.startswith("gather "))
    assert first[0] == "gather transformer.wte" and unshard[0] <= first[1] <= unshard[1], (first, unshard)
    for what, start, end in events:
        kind = what.split(" ")[0]
        if kind == "backward":
            assert backward[0] <= start <= end <= backward[1], what
        elif kind == "regather":
            assert backward[0] <= start <= backward[1], what
        elif kind == "reduce_scatter":
            assert backward[0] <= start and end <= optimizer[0], what
        elif kind == "gather" and what != "gather transformer.wte":  # (wte: the UNSHARD action before F)
            assert forward[0] <= start <= forward[1], what
    assert [record for record in events if " " not in record[0]] == actions_only  # (without layers: the actions)
