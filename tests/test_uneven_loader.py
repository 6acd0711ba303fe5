"""pm.batches(loader): loaders that yield different numbers of batches on different ranks are an error on every
rank, naming the ranks and their counts, at the batch where they differ: no rank waits in a step for a rank
that has left the loop."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

import models
from autopar import Mesh, parallelize

DATA = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


class Rows(IterableDataset):
    """The first ``n`` rows of DATA, split into inputs and targets; no length (as a streamed dataset)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for row in DATA[: self.n]:
            yield row[:4], row[4:]


def _train(counts: list[int], with_length: bool | list[bool]) -> tuple[int, str | None]:
    """Trains on this rank's loader of ``counts[rank]`` batches of 1 (with a length: ``with_length``, or its
    item for this rank); the steps done and the error, if any."""
    pm = parallelize(models.mlp((4, 2)), Mesh(dp=2), loss_fn=models.mse, optimizer=models.sgd, batch="local")
    n = counts[dist.get_rank()]
    if isinstance(with_length, list):
        with_length = with_length[dist.get_rank()]
    loader = DataLoader(Rows(n), batch_size=1) if not with_length else [(DATA[i:i + 1, :4], DATA[i:i + 1, 4:])
                                                                        for i in range(n)]
    steps = 0
    try:
        for x, y in pm.batches(loader):
            pm.step(x, target=y)
            steps += 1
    except ValueError as e:
        return steps, str(e)
    return steps, None


@pytest.mark.parametrize("with_length", [False, [True, False]], ids=["no-lengths", "one-length"])
def test_loaders_of_one_length_run_every_batch(launcher, with_length: bool | list[bool]) -> None:
    """Also where only some ranks' loaders have a length: lengths are compared among those that have one, the
    others checked batch by batch."""
    assert launcher(_train, 2, [3, 3], with_length) == [(3, None), (3, None)]


@pytest.mark.parametrize("counts, ended, going", [([3, 2], 1, 0), ([2, 3], 0, 1)], ids=["rank1-ends", "rank0-ends"])
def test_a_loader_that_ends_early_is_named_on_every_rank(launcher, counts: list[int], ended: int,
                                                         going: int) -> None:
    """Whichever rank's loader ends first (rank 0's too: no rank decides alone for the others)."""
    results = launcher(_train, 2, counts, False)
    for steps, error in results:  # every rank stops at the third batch, with the same error
        assert steps == 2
        assert error is not None and error.startswith(
            f"the loaders of rank {ended} ended after 2 batches, while those of rank {going} yielded a "
            "batch 3; every rank must yield the same number of batches"), error


def test_loaders_of_different_lengths_are_named_before_the_first_step(launcher) -> None:
    for steps, error in launcher(_train, 2, [3, 2], True):
        assert steps == 0
        assert "the ranks' loaders have different numbers of batches (rank 0: 3, rank 1: 2)" in error, error
