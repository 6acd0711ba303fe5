"""Iterating a loader in step with every other rank: each rank gets its next batch, or every rank stops.

A training loop runs one step per batch, and every step is a collective
program: a rank whose loader yields fewer batches than another's leaves the
loop while the others wait in their next step's collectives, until the
process group's timeout (or, when the early rank's process exits, an error
that names only a closed connection). ``pm.batches(loader)`` (``in_step``)
makes that a clear error on every rank at the batch where it happens:

- before the first batch, where every rank's loader has a length, the ranks
  compare the lengths (one all-gather of one integer), and different lengths
  are an error naming each rank's count;
- before each batch, each rank says whether its loader has one more (one
  all-gather of one integer per batch), so that a loader without a length
  (an iterable dataset) that runs out early is named with the batch count
  at which it ended.

Every rank of the job iterates through it, the ranks that pass nothing to
``step`` too (they iterate their own loader, or any iterable of as many items).
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

FIX = ("every rank must yield the same number of batches: a DistributedSampler(num_replicas=pm.dp_size, "
       "rank=pm.dp_rank) pads its shards to one length (with drop_last=True it drops the remainder), and a "
       "DataLoader over it with drop_last=True drops a short last batch alike on every rank")


def in_step(loader: Iterable, device: torch.device) -> Iterator[Any]:
    """``loader``'s items, each once every rank of the job has one (the ranks' loaders agree on their number);
    a ``ValueError`` on every rank, naming the ranks and their counts, where they do not."""
    _check_lengths(_length(loader), device)
    items, count = iter(loader), 0
    while True:
        try:
            item, more = next(items), True
        except StopIteration:
            item, more = None, False
        flags = _gather(int(more), device)
        if all(flags):
            count += 1
            yield item
        elif not any(flags):
            return
        else:
            ended = [r for r, f in enumerate(flags) if not f]
            going = [r for r, f in enumerate(flags) if f]
            raise ValueError(f"the loaders of {_ranks(ended)} ended after {count} batches, while those of "
                             f"{_ranks(going)} yielded a batch {count + 1}; {FIX}")


def _length(loader: Iterable) -> int:
    """``len(loader)``, or -1 where it has none (a DataLoader over an iterable dataset raises TypeError)."""
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return -1


def _check_lengths(length: int, device: torch.device) -> None:
    lengths = _gather(length, device)
    if len({n for n in lengths if n >= 0}) > 1:
        counts = ", ".join(f"rank {r}: {n}" if n >= 0 else f"rank {r}: no length" for r, n in enumerate(lengths))
        raise ValueError(f"the ranks' loaders have different numbers of batches ({counts}); {FIX}")


def _gather(value: int, device: torch.device) -> list[int]:
    """``value`` of every rank, by rank."""
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [int(t) for t in everyone]


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
