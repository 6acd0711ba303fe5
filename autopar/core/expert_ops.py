"""Expert parallelism at run time: the routed experts of one layer spread over the ``ep`` axis.

``ExpertParallel`` is what ``passes/expert_parallel.py`` puts in a graph in place of a layer's dense expert
dispatch. Its output, (T, H) like the input, has a static shape; the data-dependent sizes (how many rows
each expert receives) live inside it, so the rest of the graph stays static. On each rank it:

1. sorts the (token, slot) pairs by expert (stable: within an expert, tokens in order) and counts them;
2. exchanges the counts over ``ep`` (``all_to_all`` of (ep, E/ep) integers: each rank learns how many rows
   it receives for each of its experts from each rank);
3. sends each row to the rank holding its expert (``autopar::all_to_all_v``, variable splits: the dispatch);
4. runs each of its E/ep experts on the rows it received for it, from every rank (its own graph, copied
   from the model's);
5. sends the outputs back (``all_to_all_v`` with the splits reversed: the combine), multiplies each by its
   routing weight and adds them up per token in expert order, as the model's loop does.

``all_to_all_v``'s backward is the same exchange with the splits reversed, so autograd gives each expert
the gradient of every row it computed, and each token the gradient through its experts and weights.
Expert ``e`` lives on ep index ``e // (E/ep)``, at row ``e % (E/ep)`` of stacked expert weights.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake

from autopar.core.collectives import axis_index, current

AXIS = "ep"


@torch.library.custom_op("autopar::all_to_all_v", mutates_args=())
def all_to_all_v(x: torch.Tensor, axis: str, send: list[int], recv: list[int]) -> torch.Tensor:
    """Rows ``x`` (sum(send), ...) sent ``send[j]`` to rank j of ``axis``; returns the ``recv[j]`` rows from
    each rank j, in rank order."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    current().record("all_to_all_v", axis, x)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                           group=current().group(axis))
    return out


def _keep_splits(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    ctx.axis, ctx.send, ctx.recv = inputs[1:]


all_to_all_v.register_fake(lambda x, axis, send, recv: x.new_empty((sum(recv), *x.shape[1:])))
all_to_all_v.register_autograd(  # backward: the same exchange with the splits reversed
    lambda ctx, g: (all_to_all_v(g.contiguous(), ctx.axis, ctx.recv, ctx.send), None, None, None),
    setup_context=_keep_splits)


def exchange_counts(counts: torch.Tensor, axis: str) -> torch.Tensor:
    """(ep, L) rows counted for each rank's experts -> (ep, L): row j what rank j sends for this rank's experts."""
    out = torch.empty_like(counts)
    current().record("all_to_all", axis, counts)
    dist.all_to_all_single(out, counts.contiguous(), group=current().group(axis))
    return out


class ExpertParallel(torch.nn.Module):
    """One layer's routed experts over the ``ep`` axis: ``(x (T, H), indices (T, k), weights (T, k), *params)``
    -> the weighted sum of each token's experts (T, H) in ``dtype``.

    ``experts[e]`` computes expert ``e`` on rows: ``(rows (R, H), *its parameters) -> (R, H)``; ``uses[e]``
    says which of ``params`` it takes. Parameters of experts another rank holds arrive empty and are unused.
    """

    def __init__(self, name: str, experts: list[fx.GraphModule], uses: list[list[int]], ep: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        if len(experts) % ep:
            raise ValueError(f"{len(experts)} experts do not divide by ep={ep}")
        self.name, self.ep, self.dtype = name, ep, dtype
        self.experts = torch.nn.ModuleList(experts)
        self.uses = [list(u) for u in uses]
        self.count = len(experts)  # the layer's experts

    @property
    def local(self) -> int:
        """Experts per rank."""
        return self.count // self.ep

    def held_by(self, index: int) -> range:
        """The experts ep index ``index`` holds."""
        return range(index * self.local, (index + 1) * self.local)

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        if is_fake(x):  # shape propagation at compile time: the output's shape is static
            return x.new_empty(x.shape, dtype=self.dtype)
        t, k = indices.shape
        n, local = self.count, self.local
        flat = indices.reshape(-1)  # (T*k,)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs by expert
        tokens = order // k
        counts = torch.bincount(flat, minlength=n).view(self.ep, local)  # (ep, E/ep): rows for each rank's experts
        received = exchange_counts(counts, AXIS)  # (ep, E/ep): rows each rank sends to this rank's experts
        send, recv = counts.sum(1).tolist(), received.sum(1).tolist()
        rows = all_to_all_v(x[tokens], AXIS, send, recv)  # (sum(recv), H): by source rank, then expert
        outputs = self._run_local(rows, received, params)
        back = all_to_all_v(outputs, AXIS, recv, send)  # (T*k, H) in the sorted order
        weighted = (back * weights.reshape(-1)[order].unsqueeze(-1)).to(self.dtype)
        return torch.zeros((t, *x.shape[1:]), dtype=self.dtype, device=x.device).index_add(0, tokens, weighted)

    def _run_local(self, rows: torch.Tensor, received: torch.Tensor, params: tuple) -> torch.Tensor:
        """This rank's experts, each on its rows from every rank; the outputs in the order the rows came."""
        index, local = axis_index(AXIS), self.local
        sizes = received.reshape(-1).tolist()  # source-major: (source rank, local expert)
        pieces = list(rows.split(sizes))
        for j, e in enumerate(self.held_by(index)):
            mine = [s * local + j for s in range(self.ep)]
            out = self.experts[e](torch.cat([pieces[i] for i in mine]), *(params[u] for u in self.uses[e]))
            for i, part in zip(mine, out.split([sizes[i] for i in mine])):
                pieces[i] = part
        return torch.cat(pieces)


class GroupedExpertParallel(ExpertParallel):
    """``ExpertParallel`` for experts computed together as grouped matmuls (Hugging Face's grouped form):
    ``body(rows (R, H), *stacked weights, offsets (E/ep,)) -> (R, H)`` runs this rank's experts at once on the
    rows it received, ordered by expert, with its E/ep rows of each stacked weight (``params``) and offsets
    (one past each local expert's last row) counted from what every rank sent."""

    def __init__(self, name: str, body: fx.GraphModule, experts: int, ep: int, dtype: torch.dtype) -> None:
        if experts % ep:
            raise ValueError(f"{experts} experts do not divide by ep={ep}")
        super().__init__(name, [], [], ep, dtype)
        self.body, self.count = body, experts

    def _run_local(self, rows: torch.Tensor, received: torch.Tensor, params: tuple) -> torch.Tensor:
        """The rows arrive by source rank, then expert: regrouped by expert for ``body``, then put back."""
        local = self.local
        sizes = received.reshape(-1).tolist()  # source-major: (source rank, local expert)
        pieces = rows.split(sizes)
        order = [s * local + j for j in range(local) for s in range(self.ep)]  # expert-major
        offsets = torch.cumsum(received.sum(0), 0, dtype=torch.int32)
        out = self.body(torch.cat([pieces[i] for i in order]), *params, offsets)
        back = dict(zip(order, out.split([sizes[i] for i in order])))
        return torch.cat([back[i] for i in range(len(sizes))])
