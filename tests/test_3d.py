"""dp x pp x tp (+ ZeRO) together on 8 local ranks equals single-device training, in any axis order."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import models
from autopar import Mesh
from autopar.testing import assert_equivalent

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("name,zero", [
    pytest.param("gpt2", 0, marks=pytest.mark.slow), pytest.param("llama", 0, marks=pytest.mark.slow),
    pytest.param("bert", 0, marks=pytest.mark.slow), ("gpt2", 3), pytest.param("llama", 2, marks=pytest.mark.slow),
    pytest.param("bert", 1, marks=pytest.mark.slow)])
def test_dp2_pp2_tp2(launcher, name: str, zero: int) -> None:
    """Eight ranks on the machine's cores: GPT-2 (tied embeddings on both pipeline ends) at ZeRO-3 by default,
    the other models and stages under -m slow; LLaMA runs on 8 ranks by default in the axis-order test."""
    assert_equivalent(models.factory(getattr(models, name), layers=4), Mesh(dp=2, pp=2, tp=2), (IDS,), TARGET,
                      models.lm_loss, models.adamw, steps=2, rtol=1e-8, atol=1e-9, launcher=launcher, microbatches=2,
                      zero=zero, bucket_mb=1e-3)


@pytest.mark.slow
def test_axis_order_is_free(launcher) -> None:
    """Axes in another order than dp, pp, tp on 8 ranks (the rank layout of each order is unit-tested in
    test_mesh.py; the drawn meshes under -m slow permute the axes too)."""
    assert_equivalent(models.factory(models.llama, layers=4), Mesh(tp=2, pp=2, dp=2), (IDS,), TARGET,
                      models.lm_loss, models.adamw, steps=2, rtol=1e-8, atol=1e-9, launcher=launcher, microbatches=2)


def _factorizations(n: int) -> list[dict[str, int]]:
    return [{"dp": d, "pp": p, "tp": n // (d * p)} for d in (1, 2, 4, 8) for p in (1, 2, 4)
            if n % (d * p) == 0 and n // (d * p) in (1, 2, 4)]


@pytest.mark.slow
@given(sizes=st.sampled_from(_factorizations(4) + _factorizations(8)), order=st.permutations(["dp", "pp", "tp"]),
       schedule=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]),
       config=st.sampled_from([("llama", 4, 4, 2), ("gpt2", 4, 4, 4), ("llama", 4, 8, 4)]),
       zero=st.sampled_from([0, 1, 2, 3]), clip=st.sampled_from([None, 0.05]))
def test_random_meshes_zero_stages_schedules_and_transformers(launcher, sizes, order, schedule, config,
                                                              zero, clip) -> None:
    name, layers, heads, kv = config
    mesh = Mesh(**{axis: sizes[axis] for axis in order})
    microbatches = 2 * mesh.pp if schedule == "interleaved-1f1b" else 2
    batch = mesh.dp * microbatches
    ids = torch.randint(0, 96, (batch, 6), generator=torch.Generator().manual_seed(batch))
    kw = {"layers": layers, "heads": heads, "d": 32} | ({"kv_heads": kv} if name == "llama" else {})
    assert_equivalent(models.factory(getattr(models, name), **kw), mesh, (ids,), ids, models.lm_loss, models.adamw,
                      steps=2, rtol=1e-8, atol=1e-9, launcher=launcher, schedule=schedule, microbatches=microbatches,
                      zero=zero, bucket_mb=1e-3, max_grad_norm=clip)
