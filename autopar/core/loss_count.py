"""Losses normalized by a count of their inputs: the count over the whole batch, computed before the step.

A mean over a data-dependent number of items (cross-entropy with ``ignore_index``,
a masked mean ``(x * mask).sum() / mask.sum()``, Hugging Face's ``labels=`` loss)
cannot be split over microbatches and data-parallel ranks as a mean of means:
parts with fewer counted items would weigh as much as full ones. The capture
pass ``passes/global_count.py`` rewrites each such term ``num / count`` into
``num / c`` where ``c`` is a new input of the graph, and keeps the graph that
computes ``count`` from the user inputs as ``LossCounts``. The runtime feeds
every part ``c = finish(count summed over all parts) / parts``, where
``finish`` applies the scalar ops the loss applies to its count (a clamp, a
constant added) to the whole batch's count as one device does: the parts'
losses, averaged with equal weight as autopar averages them, then sum to
``num over the whole batch / count over the whole batch``, and so do their
gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx


@dataclass
class LossCounts:
    """The graph ``gm(*flat user inputs) -> (count_0, ...)`` (float64 scalars) and each count's input dtype."""

    gm: fx.GraphModule
    dtypes: list[torch.dtype]  # the dtype of the graph input ``c`` each count feeds
    sources: list[str]  # the loss node each count normalizes (for the plan and errors)
    finish: fx.GraphModule | None = None  # (total_0, ...) -> the loss's counts of the whole batch, float64

    def per_part(self, total: torch.Tensor, parts: int) -> list[torch.Tensor]:
        """What each of ``parts`` parts feeds the count inputs, from ``total``, the counts summed over them."""
        finished = self.finish(*total) if self.finish is not None else total
        return [(t.double() / parts).to(dtype=dtype) for t, dtype in zip(finished, self.dtypes)]

    def count(self, flat_inputs: list[Any]) -> torch.Tensor:
        """The counts of one part, float64, stacked."""
        return torch.stack([c.double() for c in self.gm(*flat_inputs)])

    def inputs(self, parts: list[list[Any]], device: torch.device | str) -> list[torch.Tensor]:
        """What every part feeds the graph's count inputs: each count over all ``parts``, over ``len(parts)``."""
        total = sum(self.count(flat).cpu() for flat in parts)
        return [t.to(device=device) for t in self.per_part(total, len(parts))]
