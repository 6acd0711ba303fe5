"""autopar.testing.strategies: every configuration drawn runs, and a property test over them finds a broken build."""
from __future__ import annotations

import functools

import torch
from hypothesis import HealthCheck, find, given, settings

import models
from autopar.core.schedules import make_schedule
from autopar.options import Options
from autopar.testing import assert_equivalent, strategies

X = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
Y = torch.randn(8, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
MLP = functools.partial(models.mlp, (6, 8, 8, 2))


@settings(max_examples=200, deadline=None, database=None)
@given(config=strategies.configs(world=8, batch_size=16, max_stages=4, precision=("fp32", "bf16", "mixed")))
def test_every_configuration_drawn_is_valid(config: strategies.Config) -> None:
    mesh, options = config.mesh, Options(**config.options)
    assert mesh.size == 8 and mesh.pp <= 4 and 16 % (mesh.dp * options.microbatches) == 0
    assert options.zero == 0 or mesh.dp > 1
    assert not options.sequence_parallel or mesh.tp > 1
    if mesh.pp > 1:
        assert mesh.pp * options.virtual_stages <= 4
        make_schedule(options.schedule, mesh.pp, options.microbatches, options.virtual_stages)  # raises if invalid


def _sum_instead_of_mean(fn, *args):
    """Runs ``fn`` with the data-parallel gradient average broken: gradients summed over dp, not averaged."""
    from autopar.runtime.grad_sync import BucketedAllReduce

    place = BucketedAllReduce._place

    def broken(self, bucket, i):
        place(self, bucket, i)
        bucket.views[i].mul_(self.size)

    BucketedAllReduce._place = broken
    try:
        return fn(*args)
    finally:
        BucketedAllReduce._place = place


def test_a_property_test_over_the_strategies_finds_a_broken_build(pool) -> None:
    def broken_launcher(fn, nprocs, *args):
        return pool.launch(_sum_instead_of_mean, nprocs, fn, *args)

    def fails(config: strategies.Config) -> bool:
        try:
            assert_equivalent(MLP, config.mesh, (X,), Y, models.mse, models.sgd, steps=1, launcher=broken_launcher,
                              **config.options)
        except AssertionError:
            return True
        return False

    found = find(strategies.configs(world=2, batch_size=8, max_stages=2, zero=(0,), recompute=("none",)), fails,
                 settings=settings(max_examples=20, deadline=None, database=None,
                                   suppress_health_check=list(HealthCheck)))
    assert found.mesh.dp == 2, found  # the broken average is the data-parallel one
