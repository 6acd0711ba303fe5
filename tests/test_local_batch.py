"""batch="local": each data-parallel rank passes its own shard; training equals one device on the shards
concatenated in dp order (float64), and shards of different shapes are refused on every rank."""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.testing import Run, reference_run, relative_errors

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))
TARGET[:4, :5] = -100  # dp rank 0's shard counts fewer tokens than dp rank 1's


def gpt2() -> torch.nn.Module:
    return models.gpt2(layers=2, d=32, heads=4)


def _train_on_shards(mesh: Mesh, options: dict, steps: int) -> dict:
    import torch.distributed as dist

    pm = parallelize(gpt2(), mesh, loss_fn=models.lm_loss, optimizer=models.adamw, batch="local", **options)
    n = IDS.shape[0] // pm.dp_size
    ids, target = IDS[pm.dp_rank * n:][:n], TARGET[pm.dp_rank * n:][:n]
    losses = [pm.step(ids, target=target)]  # (the first step compiles: every rank passes its shard)
    fed = pm.reads_batch
    for _ in range(steps - 1):
        losses.append(pm.step(ids, target=target) if fed else pm.step())
    out = pm(ids)
    return {"run": Run(losses, out, pm.state_dict()), "reads": fed, "rank": dist.get_rank(), "dp": pm.dp_rank}


@pytest.mark.parametrize("mesh, options", [
    (Mesh(dp=2), {"microbatches": 2}),
    (Mesh(dp=2, pp=2), {"microbatches": 2, "zero": 1}),
    pytest.param(Mesh(dp=2, pp=2, tp=2), {"microbatches": 2, "zero": 1}, marks=pytest.mark.slow),
], ids=["dp2", "dp2-pp2", "dp2-pp2-tp2"])
def test_local_shards_train_as_the_concatenated_batch(launcher, mesh: Mesh, options: dict) -> None:
    ref = reference_run(gpt2, (IDS,), TARGET, models.lm_loss, models.adamw, steps=3)
    results = launcher(_train_on_shards, mesh.size, mesh, options, 3)
    for res in results:
        run = res["run"]
        n = IDS.shape[0] // mesh.dp
        whole = ref.output.logits[res["dp"] * n:][:n]
        assert torch.allclose(run.output.logits, whole, rtol=1e-12, atol=1e-12), res["rank"]
        run.output = ref.output  # (the output is this rank's shard: compared above)
        worst, what = relative_errors(ref, run)
        assert worst <= 1e-12, (res["rank"], worst, what)
    assert all(res["reads"] for res in results)  # (pp=2: the first stage reads the ids, the last the target)


def _mismatched_shards(mesh: Mesh) -> str:
    import torch.distributed as dist

    pm = parallelize(gpt2(), mesh, loss_fn=models.lm_loss, optimizer=models.sgd, batch="local")
    rows = 2 if dist.get_rank() == 0 else 4
    try:
        pm.step(IDS[:rows], target=TARGET[:rows])
    except ValueError as e:
        return str(e)
    return "no error"


def test_shards_of_different_shapes_are_refused_on_every_rank(launcher) -> None:
    messages = launcher(_mismatched_shards, 2, Mesh(dp=2))
    for text in messages:
        assert "rank 0: [2, 8], [2, 8]" in text and "rank 1: [4, 8], [4, 8]" in text, text


def test_a_rank_without_inputs_to_read_may_pass_nothing(launcher) -> None:
    """pp=4 over a 4-layer model: the two middle stages read neither the ids nor the target."""
    make = models.factory(models.gpt2, layers=4, d=32, heads=4)
    mesh, options = Mesh(pp=4), {"microbatches": 2}
    ref = reference_run(make, (IDS,), TARGET, models.lm_loss, models.sgd, steps=2)
    results = launcher(_pp_with_empty_ranks, 4, make, mesh, options)
    assert [r["reads"] for r in results] == [True, False, False, True]
    for res in results:
        assert max(abs(a - b) / a for a, b in zip(ref.losses, res["losses"])) <= 1e-12


def _pp_with_empty_ranks(make, mesh: Mesh, options: dict) -> dict:
    pm = parallelize(make(), mesh, loss_fn=models.lm_loss, optimizer=models.sgd, batch="local",
                     example_inputs=(IDS,), example_target=TARGET, **options)
    reads = pm.reads_batch
    losses = [pm.step(IDS, target=TARGET) if reads else pm.step() for _ in range(2)]
    return {"reads": reads, "losses": losses}
