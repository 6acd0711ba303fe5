"""The plan's time to the first step (export, passes, runtime start, the first step), and the host allocator."""
from __future__ import annotations

import torch

import models
from autopar import Mesh, parallelize
from autopar.runtime.host_memory import keep_freed_memory

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))


def _first_step(mesh_axes: dict) -> list:
    pm = parallelize(models.gpt2(dtype=torch.float32), Mesh(**mesh_axes), loss_fn=models.lm_loss,
                     optimizer=models.sgd, microbatches=2)
    pm.step(IDS, target=IDS)
    first = pm.plan.timings
    pm.step(IDS, target=IDS)
    return [first, pm.plan.timings, str(pm.plan), keep_freed_memory()]


def test_the_plan_times_the_first_step_on_four_ranks(launcher) -> None:
    for first, later, text, kept in launcher(_first_step, 4, {"dp": 2, "pp": 2}):
        assert first.export > 0 and first.passes > 0 and first.runtime > 0 and first.first_step > 0
        assert later == first  # (the first step's, not the latest)
        assert "time to the first step: export " in text and "first step " in text
        assert kept  # CPU ranks on glibc keep their freed memory


def test_a_compile_time_plan_shows_no_times() -> None:
    pm = parallelize(models.gpt2(dtype=torch.float32), Mesh(dp=2), example_inputs=(IDS,), example_target=IDS,
                     loss_fn=models.lm_loss)
    assert pm.plan.timings.export > 0 and pm.plan.timings.runtime is None
    assert "time to the first step" not in str(pm.plan)  # (plans made without running stay the same text)
