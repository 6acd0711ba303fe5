"""Pipeline parallelism on real gloo ranks equals single-device training."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import models
from autopar import Mesh, parallelize
from autopar.testing import assert_equivalent

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))


def _hf(name: str, launcher, mesh: Mesh, **kw) -> None:
    make = models.factory(getattr(models, name), layers=4)
    assert_equivalent(make, mesh, (IDS,), TARGET, models.lm_loss, models.adamw, steps=2, rtol=1e-9, atol=1e-10,
                      launcher=launcher, **kw)


PP2 = [(name, schedule, m) for name in ("llama", "gpt2", "bert")
       for schedule, m in [("gpipe", 2), ("1f1b", 4), ("interleaved-1f1b", 4)]]
PP2_DEFAULT = {("llama", "gpipe", 2), ("gpt2", "1f1b", 4), ("bert", "interleaved-1f1b", 4)}


@pytest.mark.parametrize("name, schedule, microbatches",
                         [pytest.param(*c, marks=[] if c in PP2_DEFAULT else [pytest.mark.slow]) for c in PP2])
def test_hf_pp2(launcher, name: str, schedule: str, microbatches: int) -> None:
    """Each schedule with another model; every model with every schedule under -m slow."""
    _hf(name, launcher, Mesh(pp=2), schedule=schedule, microbatches=microbatches)


@pytest.mark.parametrize("name, schedule, microbatches", [
    pytest.param("llama", "1f1b", 4, marks=pytest.mark.slow), ("gpt2", "gpipe", 8),
    pytest.param("bert", "1f1b", 2, marks=pytest.mark.slow)])
def test_hf_pp4(launcher, name: str, schedule: str, microbatches: int) -> None:
    _hf(name, launcher, Mesh(pp=4), schedule=schedule, microbatches=microbatches)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
@pytest.mark.parametrize("microbatches", [4, 8])
def test_hf_pipeline_matrix(launcher, name: str, pp: int, schedule: str, microbatches: int) -> None:
    _hf(name, launcher, Mesh(pp=pp), schedule=schedule, microbatches=microbatches)


def test_gpt2_dp2_pp2(launcher) -> None:
    """pp x dp: tied embeddings synced across stages, gradients averaged across replicas."""
    _hf("gpt2", launcher, Mesh(dp=2, pp=2), schedule="1f1b", microbatches=2)


def test_user_split_points(launcher) -> None:
    _hf("llama", launcher, Mesh(pp=2), microbatches=2, split_points=["model.layers.1"])


@st.composite
def skip_models(draw):
    depth = draw(st.integers(4, 8))
    pairs = [(i, j) for i in range(depth) for j in range(i + 2, depth)]
    skips = tuple(sorted(draw(st.sets(st.sampled_from(pairs), min_size=1, max_size=4))))
    return depth, skips, draw(st.integers(2, 6))


@given(model=skip_models(), pp=st.sampled_from([2, 4]), schedule=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]),
       m_per=st.sampled_from([1, 2]))
@example(model=(4, ((0, 2),), 2), pp=4, schedule="interleaved-1f1b", m_per=1)  # a rank whose stages hold no parameter
def test_random_skip_connections_across_stages(launcher, model, pp, schedule, m_per) -> None:
    depth, skips, width = model
    microbatches = pp * m_per if schedule == "interleaved-1f1b" else m_per * 2
    batch = microbatches * 2
    g = torch.Generator().manual_seed(depth)
    x = torch.randn(batch, width, dtype=torch.float64, generator=g)
    y = torch.randn(batch, 2, dtype=torch.float64, generator=g)
    make = models.factory(models.skipnet, width=width, depth=depth, skips=skips)
    assert_equivalent(make, Mesh(pp=pp), (x,), y, models.mse, models.sgd, steps=2, rtol=1e-9, atol=1e-11,
                      launcher=launcher, schedule=schedule, microbatches=microbatches)


def test_plan_shows_stages_and_the_shared_embedding() -> None:
    pm = parallelize(models.gpt2(layers=4), Mesh(pp=2), example_inputs=(IDS,), example_target=TARGET,
                     loss_fn=models.lm_loss, optimizer=models.adamw, microbatches=4)
    text = str(pm.plan)
    assert "2 stages over 2 pp ranks" in text and "bubble 20.0%" in text
    assert "transformer.wte.weight is used on pp ranks [0, 1]" in text
    assert pm.graph(0) is not pm.graph(1)
    code0, code1 = pm.graph(0).code, pm.graph(1).code
    assert "embedding" in code0 and "cross_entropy" not in code0 and "cross_entropy" in code1


@pytest.mark.parametrize("kwargs, message", [
    (dict(mesh=Mesh(pp=4), model=(8, 4)), r"cannot cut the model into 4 stages: its graph has only \d module boundaries"),
    (dict(mesh=Mesh(pp=2), schedule="interleaved-1f1b", microbatches=3), "microbatches"),
    (dict(mesh=Mesh(pp=2), microbatches=3), r"batch 8 does not divide by dp\*microbatches = 1\*3 = 3"),
    (dict(mesh=Mesh(pp=2), split_points=["blocks.9"]), "split point 'blocks.9' names no module of the model"),
    (dict(mesh=Mesh(pp=2), split_points=["blocks.1", "blocks.2"]), "2 split points give 3 stages"),
])
def test_bad_pipeline_input(kwargs: dict, message: str) -> None:
    widths = kwargs.pop("model", None)
    model = models.mlp(widths) if widths else models.skipnet()
    x = torch.randn(8, widths[0] if widths else 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        parallelize(model, kwargs.pop("mesh"), example_inputs=(x,), **kwargs)


ROWS, WIDTH = 32, 128  # rows per microbatch; a message is ROWS * WIDTH float64s (32 KiB)


def _step_peaks() -> dict[int, int]:
    """Per number of microbatches (of ROWS rows each), the most bytes a 1F1B step on pp=2 allocates and holds at
    once (after a first step has made the gradients and optimizer state)."""
    from autopar.runtime.memory import NewStorages

    out = {}
    for m in (2, 8):
        torch.manual_seed(0)
        x, y = torch.randn(m * ROWS, WIDTH, dtype=torch.float64), torch.randn(m * ROWS, WIDTH, dtype=torch.float64)
        pm = parallelize(models.mlp((WIDTH,) * 5), Mesh(pp=2), loss_fn=models.mse, optimizer=models.sgd,
                         schedule="1f1b", microbatches=m)
        pm.step(x, target=y)
        with NewStorages() as mode:
            pm.step(x, target=y)
        out[m] = mode.peak
    return out


def test_a_1f1b_step_holds_what_its_microbatches_in_flight_need(launcher) -> None:
    """A stage frees a microbatch's received inputs and their gradients once it has sent the gradients back (the
    last stage's loss, kept for the step's mean, no longer holds them through its graph), so six more
    microbatches raise a rank's peak by at most the step's copies of their inputs and targets (two messages
    each), not by what it received. Numbers cannot show a stage that keeps them to the step's end."""
    message = ROWS * WIDTH * 8
    for rank, peaks in enumerate(launcher(_step_peaks, 2)):
        assert peaks[8] - peaks[2] < (8 - 2) * 2 * message + message, (rank, peaks, message)
