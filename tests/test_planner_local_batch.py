"""Planning for a local batch (``plan(local_batch=)``, ``parallelize(model, "auto", batch="local")``): each
configuration's global batch is the local one times its dp, and configurations are ranked by the time per local
batch, that is by throughput."""
from __future__ import annotations

import json

import pytest
import torch

import models
from autopar.cli import main
from autopar import parallelize
from autopar.planner import auto_choice, plan


def _llama() -> torch.nn.Module:
    return models.llama(layers=2, d=32, dtype=torch.float32)


def test_a_local_batch_is_planned_per_data_parallel_rank_and_ranked_by_throughput() -> None:
    ids = torch.zeros(2, 16, dtype=torch.long)
    result = plan(_llama(), 4, cluster="dgx-a100", local_batch=2, seq_len=16, precision="fp32", example_inputs=(ids,))
    searched = {(c.config.dp, c.config.global_batch) for c in result.every.values()}
    assert searched == {(1, 2), (2, 4), (4, 8)}
    ranked = [c for c in result.candidates if c.fits]
    rates = [c.estimate.tokens_per_s for c in ranked]
    assert len({c.config.dp for c in ranked}) > 1
    assert all(a >= b * (1 - 1e-2) for a, b in zip(rates, rates[1:])), rates
    assert result.global_batch == 0 and result.local_batch == 2
    assert "local batch 2 per data-parallel rank" in result.render()
    with pytest.raises(ValueError, match="exactly one of global_batch= and local_batch="):
        plan(_llama(), 4, cluster="cpu", global_batch=8, local_batch=2, seq_len=16, example_inputs=(ids,))


def test_parallelize_auto_plans_a_local_batch_as_each_data_parallel_ranks(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    one = (torch.zeros(1, 16, dtype=torch.long),)  # as a global batch, one sample allows no dp
    as_global = auto_choice(_llama(), "auto", example_inputs=one, example_kwargs=None, optimizer=None)
    as_local = auto_choice(_llama(), "auto", example_inputs=one, example_kwargs=None, optimizer=None, batch="local")
    assert as_global.config.dp == 1 and as_global.config.global_batch == 1
    assert as_local.config.dp == 2 and as_local.config.global_batch == 2


def test_the_cli_plans_a_local_batch(capsys) -> None:
    assert main(["plan", "autopar.planner:gpt(2, 64, 4)", "--devices", "4", "--cluster", "cpu", "--seq", "32",
                 "--local-batch", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["local_batch"] == 2 and out["global_batch"] == 0
    assert all(c["tokens_per_s"] > 0 for c in out["candidates"])
    with pytest.raises(SystemExit):
        main(["plan", "autopar.planner:gpt(2, 64, 4)", "--devices", "4", "--global-batch", "8", "--local-batch", "2"])


def _auto_local_step() -> tuple[str, float]:
    import torch.distributed as dist

    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    mine = ids[dist.get_rank():][:1]  # one sample per rank: as a global batch it would allow no dp
    pm = parallelize(models.llama(layers=2, d=32), "auto", loss_fn=models.lm_loss, optimizer=models.sgd,
                     batch="local", example_inputs=(mine,), example_target=mine)
    return repr(pm.mesh), float(pm.step(mine, target=mine))


def test_parallelize_auto_with_local_batches_trains_the_concatenated_batch(launcher) -> None:
    """On 2 ranks each passing one sample, "auto" plans dp=2 and the first loss is one device's on both."""
    results = launcher(_auto_local_step, 2)
    assert {mesh for mesh, _ in results} == {"Mesh(dp=2)"}, results
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = float(models.lm_loss(models.llama(layers=2, d=32)(ids), ids).detach())
    assert all(loss == pytest.approx(expected, rel=1e-12) for _, loss in results), (results, expected)
