"""Ring attention's exposed communication on ``pm.timeline(layers=True)``: each wait for a K/V block or its
gradients' sums is a ``ring_wait`` record inside the step's forward or backward action."""
from __future__ import annotations

import torch

import models
from autopar import Mesh, parallelize

IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
LAYERS = 2


def _timelines() -> tuple[list, list]:
    pm = parallelize(models.gpt2(layers=LAYERS), Mesh(cp=2), loss_fn=models.lm_loss, optimizer=models.sgd)
    for _ in range(2):
        pm.step(IDS, target=IDS)
    return pm.timeline(layers=True), pm.timeline()


def test_ring_waits_fall_inside_the_steps_actions(launcher) -> None:
    """At cp=2 each attention waits once forward (the other rank's K/V) and three times backward (the K/V
    block again, the sums of its gradients coming round twice): 4 waits per layer, in F and B, this step's."""
    for events, actions in launcher(_timelines, 2):
        span = {what: (start, end) for what, start, end in actions}
        waits = [(start, end) for what, start, end in events if what == "ring_wait"]
        assert [e for e in events if e[0] != "ring_wait"] == actions
        assert len(waits) == 4 * LAYERS
        forward, backward = span["0F0"], span["0B0"]
        inside = [forward[0] <= s <= e <= forward[1] for s, e in waits]
        assert sum(inside) == LAYERS
        assert all(a or backward[0] <= s <= e <= backward[1] for a, (s, e) in zip(inside, waits))


class _Logged:
    """A request of a ring exchange that logs its wait."""

    def __init__(self, work, log: list, tag: int) -> None:
        self.work, self.log, self.tag = work, log, tag

    def wait(self, *args) -> bool:
        self.log.append(("wait", self.tag))
        return self.work.wait(*args)


def _ring_order() -> list[tuple[str, int]]:
    """One step's ring exchanges issued and waited for (by tag: 0 a K/V block, 1 its gradients' sums) and the
    blocks computed (forward and backward), in order."""
    import torch.distributed as dist

    from autopar.core import ring_attention as ring

    pm = parallelize(models.gpt2(layers=LAYERS), Mesh(cp=2), loss_fn=models.lm_loss, optimizer=models.sgd)
    pm.step(IDS, target=IDS)
    log: list[tuple[str, int]] = []
    exchange, block, block_backward = dist.batch_isend_irecv, ring._block, ring._block_backward

    def issuing(ops):
        log.append(("exchange", ops[0].tag))
        return [_Logged(w, log, ops[0].tag) for w in exchange(ops)]

    def computing(run):
        return lambda *a, **k: (log.append(("compute", -1)), run(*a, **k))[1]

    dist.batch_isend_irecv, ring._block, ring._block_backward = issuing, computing(block), computing(block_backward)
    try:
        pm.step(IDS, target=IDS)
    finally:
        dist.batch_isend_irecv, ring._block, ring._block_backward = exchange, block, block_backward
    return log


def test_each_kv_block_moves_while_the_one_before_computes(launcher) -> None:
    """Numbers cannot show it: every K/V exchange (forward and backward) is waited for only after a block has
    been computed since it was issued, so the transfer overlaps that block."""
    for rank, log in enumerate(launcher(_ring_order, 2)):
        issued = [i for i, (what, tag) in enumerate(log) if what == "exchange" and tag == 0]
        assert len(issued) == 2 * LAYERS, (rank, log)  # cp=2: one exchange forward, one backward, per layer
        for i in issued:
            waited = next(j for j in range(i + 1, len(log)) if log[j] == ("wait", 0))
            assert ("compute", -1) in log[i + 1:waited], (rank, i, log)
