"""Data-parallel gradient averaging: bucketed all-reduces launched from gradient hooks.

Each bucket owns a persistent flat buffer. When a parameter's gradient is
complete (its post-accumulate-grad hook), it is divided by the group size
straight into the parameter's slot of that buffer (one pass, no separate
division), and ``.grad`` becomes a view of the slot, as DDP's
``gradient_as_bucket_view`` does. When the last gradient of a bucket has
arrived, the buffer is all-reduced asynchronously, so communication overlaps
the rest of backward; once it completes the averages are already in
``.grad``, with nothing to copy back.

Bucket layout (``autopar.core.buckets``): the first bucket is small (1 MiB), the
others ``bucket_bytes``. The first step's buckets follow reverse parameter
order; its ``finish`` rebuilds them in the order the gradients actually
arrived, as rank 0 of the group saw it (broadcast, so every rank agrees).

With ``reduce_dtype`` other than the parameters' dtype (mixed precision's
``reduce_dtype="bf16"``), the buffers are of ``reduce_dtype``: each gradient is
divided into its slot (rounded there), and ``finish`` copies the averages back
into the parameters' own ``.grad``.

Invariant: after ``finish`` each parameter that got a gradient on this step
holds the average over the group of the ranks' gradients, computed as the sum
of ``grad / size`` (bitwise what dividing before an all-reduce gives);
parameters that got none keep ``.grad = None`` on every rank, since every rank
runs the same graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from autopar.core.buckets import assign_buckets


@dataclass(eq=False)
class _Bucket:
    """Parameters whose gradients travel in one all-reduce of ``flat``; ``views`` are their slots in it."""

    index: int
    params: list[torch.Tensor]
    flat: torch.Tensor
    views: list[torch.Tensor]
    placed: list[bool]
    ready: int = 0
    launched: bool = False
    work: object = None

    def clear(self) -> None:
        self.placed = [False] * len(self.params)
        self.ready, self.launched, self.work = 0, False, None


class BucketedAllReduce:
    """Averages the gradients of ``params`` over ``group`` during backward (sums over it, each divided by
    ``divisor``, by default the group's size)."""

    def __init__(self, params: list[torch.Tensor], group: dist.ProcessGroup, bucket_bytes: int,
                 reduce_dtype: torch.dtype | None = None, divisor: int | None = None,
                 counted: Callable[[torch.Tensor], None] | None = None) -> None:
        self.group = group
        self.counted = counted  # told of each bucket all-reduced over more than one rank (``pm.communication()``)
        self.reduce_dtype = reduce_dtype
        self.size = divisor or dist.get_world_size(group)  # what each gradient is divided by before the sum
        self.bucket_bytes = bucket_bytes
        self._armed = True  # off for all but the last microbatch of an accumulation (``arm``)
        self.params = [p for p in params if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.buckets = self._layout(list(reversed(self.params)))
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.launch_order: list[int] = []  # bucket indices in launch order of the last step (for tests)
        self.launched_in_backward = 0  # buckets of the last step launched from a hook (for tests)
        self.arrival: list[int] | None = []  # indices into ``params`` as gradients arrive; None once rebuilt
        self._done = False  # the last step finished: the next launch starts a new step's bookkeeping

    def arm(self, last: bool) -> None:
        """Whether the gradients the next backward completes are reduced (``last``: its stage's last
        microbatch) or left to accumulate until then."""
        self._armed = last

    def reduce_in(self, dtype: torch.dtype) -> None:
        """Reduces in ``dtype`` from the next step on (the buckets' buffers are laid out again in it)."""
        self.reduce_dtype = dtype
        self.buckets = self._layout([p for b in self.buckets for p in b.params])

    def _layout(self, order: list[torch.Tensor]) -> list[_Bucket]:
        """Buckets over ``order`` (parameters as their gradients arrive), each with a zeroed flat buffer."""
        spans = assign_buckets([p.numel() * p.element_size() for p in order], [(p.dtype, p.device) for p in order],
                               self.bucket_bytes)
        buckets = []
        for index, span in enumerate(spans):
            members = [order[i] for i in span]
            dtype = self.reduce_dtype or members[0].dtype
            flat = torch.zeros(sum(p.numel() for p in members), dtype=dtype, device=members[0].device)
            views = list(torch.split(flat, [p.numel() for p in members]))
            buckets.append(_Bucket(index, members, flat, [v.view_as(p) for v, p in zip(views, members)],
                                   [False] * len(members)))
        self._slot = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
        return buckets

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        if self.arrival is not None:
            self.arrival.append(self._index[id(p)])
        bucket, i = self._slot[id(p)]
        self._place(bucket, i)
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)
            self.launched_in_backward += 1

    def _place(self, bucket: _Bucket, i: int) -> None:
        """Puts parameter ``i``'s ``grad / size`` in its slot and makes ``.grad`` that slot (once a step)."""
        p, view = bucket.params[i], bucket.views[i]
        if bucket.placed[i] or p.grad is None:
            return
        bucket.placed[i] = True
        if p.grad.data_ptr() == view.data_ptr():  # accumulated into last step's slot (gradients not freed)
            view.div_(self.size)
        else:  # neither tensor requires grad: nothing for autograd to record, in backward or after it
            torch.div(p.grad, self.size, out=view)
        if view.dtype == p.dtype:
            p.grad = view

    def _launch(self, bucket: _Bucket) -> None:
        if self._done:
            self.launch_order, self.launched_in_backward, self._done = [], 0, False
        bucket.launched = True
        self.launch_order.append(bucket.index)
        if all(p.grad is None for p in bucket.params):
            return
        for i in range(len(bucket.params)):
            self._place(bucket, i)  # gradients that came without a hook (sync disabled during backward)
        if self.counted is not None and dist.get_world_size(self.group) > 1:
            self.counted(bucket.flat)
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launches the buckets still waiting, waits for all; the averages are then in ``.grad``."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                for p, view, placed in zip(bucket.params, bucket.views, bucket.placed):
                    if placed and p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                        p.grad.copy_(view)  # averaged in ``reduce_dtype``: back into the parameter's dtype
            bucket.clear()
        self._done = True
        if self.arrival:
            self._rebuild(self.arrival)
            self.arrival = None

    def _rebuild(self, arrival: list[int]) -> None:
        """Lays the buckets out in rank 0's arrival order (the same on every rank); this step's ``.grad``
        stay views of the old buffers until the optimizer's ``zero_grad`` drops them."""
        seen = dict.fromkeys(arrival)
        order = [*seen, *(i for i in range(len(self.params) - 1, -1, -1) if i not in seen)]
        t = torch.tensor(order, dtype=torch.int64, device=self.params[0].device)
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        self.buckets = self._layout([self.params[i] for i in t.tolist()])

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


class GradSyncs:
    """Several gradient reductions run as one: under expert parallelism the non-expert gradients averaged over
    dp and the expert ones summed over the ranks holding the same experts and divided by dp (each holder's
    gradient already sums every rank of its ep group's tokens)."""

    def __init__(self, parts: list[BucketedAllReduce]) -> None:
        self.parts = parts

    def arm(self, last: bool) -> None:
        for p in self.parts:
            p.arm(last)

    def finish(self) -> None:
        for p in self.parts:
            p.finish()

    def remove(self) -> None:
        for p in self.parts:
            p.remove()
