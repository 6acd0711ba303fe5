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
