"""Data-parallel gradient averaging: bucketed all-reduces launched from gradient hooks.

Parameters are grouped into buckets of about ``bucket_bytes`` in reverse
graph order (the order backward produces their gradients). When the last
gradient of a bucket has been accumulated, the bucket is flattened, divided by
the group size and all-reduced asynchronously, so communication overlaps the
rest of backward, as DDP does. ``finish`` launches what is left (parameters
that got no gradient are skipped identically on every rank, since every rank
runs the same graph), waits, and writes the averages back into ``.grad``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(eq=False)
class _Bucket:
    index: int
    params: list[torch.Tensor]
    ready: int = 0
    launched: bool = False
    work: object = None
    flat: torch.Tensor | None = None
    grads: list[torch.Tensor] = field(default_factory=list)


class BucketedAllReduce:
    """Averages the gradients of ``params`` over ``group`` during backward."""

    def __init__(self, params: list[torch.Tensor], group: dist.ProcessGroup, bucket_bytes: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.enabled = True  # off for all but the last microbatch of an accumulation
        self.buckets = _make_buckets([p for p in reversed(params) if p.requires_grad], bucket_bytes)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for b in self.buckets for p in b.params]
        self.launch_order: list[int] = []  # bucket indices in launch order of the last step (for tests)

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        self.launch_order.append(bucket.index)
        bucket.grads = [p.grad for p in bucket.params if p.grad is not None]
        if not bucket.grads:
            return
        bucket.flat = torch.cat([g.reshape(-1) for g in bucket.grads]).div_(self.size)
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launches the buckets still waiting, waits for all, and writes the averages back."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                offset = 0
                for g in bucket.grads:
                    g.copy_(bucket.flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
            bucket.ready, bucket.launched, bucket.work, bucket.flat, bucket.grads = 0, False, None, None, []

    def reset(self) -> None:
        self.launch_order = []
        for bucket in self.buckets:
            bucket.ready, bucket.launched, bucket.work, bucket.flat, bucket.grads = 0, False, None, None, []

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def _make_buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    size = bucket_bytes  # forces a new bucket for the first parameter
    for p in params:
        nbytes = p.numel() * p.element_size()
        if size + nbytes > bucket_bytes and (not buckets or buckets[-1].params):
            buckets.append(_Bucket(index=len(buckets), params=[]))
            size = 0
        buckets[-1].params.append(p)
        size += nbytes
    return buckets
