"""Pipeline execution: one rank runs its schedule's actions over its stage graphs.

Shapes and dtypes of everything that crosses a cut are known from the graph,
so receive buffers are allocated up front and no shape handshake happens at
run time. Sends are non-blocking (``isend``; completed at the end of the step)
and receives block, the semantics ``autopar.core.simulate`` checks schedules under.
Every message has its own tag, so no ordering between messages is assumed.
Microbatch losses are scaled by ``1/m`` so the accumulated gradients are those
of the mean loss over the rank's batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from autopar.core.graph import Boundary, StageGraph
from autopar.core.schedule import B, F, RECV_B, RECV_F, SEND_B, SEND_F, Schedule, add_communication


def _tag(stage: int, microbatch: int, backward: bool, n_stages: int) -> int:
    return (microbatch * n_stages + stage) * 2 + int(backward)


def _send(tensors: list[torch.Tensor], dst: int, tag: int, works: list) -> None:
    for i, t in enumerate(tensors):
        t = t.detach()
        t = (t.to(torch.uint8) if t.dtype == torch.bool else t).contiguous()
        works.append((dist.isend(t, dst, tag=tag * 64 + i), t))


def _recv(metas: list[tuple[tuple[int, ...], torch.dtype]], src: int, tag: int, device: torch.device) -> list[torch.Tensor]:
    out = []
    for i, (shape, dtype) in enumerate(metas):
        wire = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=device)
        dist.irecv(wire, src, tag=tag * 64 + i).wait()
        out.append(wire.to(torch.bool) if dtype == torch.bool else wire)
    return out


@dataclass
class _Ctx:
    inputs: dict[tuple[int, int], list[torch.Tensor]]
    outputs: dict[tuple[int, int], list[torch.Tensor]]
    grads: dict[tuple[int, int], list[torch.Tensor]]
    losses: dict[int, torch.Tensor]
    works: list


class PipelineRunner:
    """Runs ``schedule``'s actions for pipeline rank ``pp_index``; each call gets the program's stage graphs."""

    def __init__(self, schedule: Schedule, pp_index: int, global_rank_of_pp: Callable[[int], int],
                 device: torch.device) -> None:
        self.stages: list[StageGraph] = []
        self.schedule = add_communication(schedule)
        self.actions = self.schedule.actions[pp_index]
        self.rank_of_stage = lambda s: global_rank_of_pp(schedule.stage_to_rank[s])
        self.device = device
        self.mine = [s for s in range(schedule.n_stages) if schedule.stage_to_rank[s] == pp_index]
        self.timeline: list[tuple[str, float, float]] = []  # (action, start, end) of the last step, perf_counter s
        self.peak_in_flight: dict[int, int] = {}  # stage -> most microbatches held between F and B, last step

    def _args(self, stage: StageGraph, state: dict, constants: dict, flat_inputs: list, recv: list) -> list:
        it = iter(recv)
        return [
            flat_inputs[int(s.name)] if s.kind == "input" else next(it) if s.kind == "recv"
            else constants[s.name] if s.kind == "constant" else state[s.name]
            for s in stage.slots
        ]

    def _receive_forward(self, s: int, mb: int) -> list[torch.Tensor]:
        metas = [(b.shape, b.dtype) for b in self.stages[s].recv]
        got = _recv(metas, self.rank_of_stage(s - 1), _tag(s, mb, False, len(self.stages)), self.device)
        return [t.requires_grad_(b.requires_grad) for t, b in zip(got, self.stages[s].recv)]

    def step(self, stages: list[StageGraph], microbatches: list[list[Any]], state: dict, constants: dict,
             before_backward: Callable[[int], None] = lambda mb: None) -> torch.Tensor | None:
        """Forward and backward of every microbatch; the mean loss (on the rank holding the last stage)."""
        self.stages = stages
        m = len(microbatches)
        n = len(self.stages)
        ctx = _Ctx({}, {}, {}, {}, [])
        self.timeline, self.peak_in_flight = [], {s: 0 for s in self.mine}
        for a in self.actions:
            start = time.perf_counter()
            s, mb, stage = a.stage, a.microbatch, self.stages[a.stage]
            key = (s, mb)
            if a.kind == RECV_F:
                ctx.inputs[key] = self._receive_forward(s, mb)
            elif a.kind == F:
                outs = stage.gm(*self._args(stage, state, constants, microbatches[mb], ctx.inputs.get(key, [])))
                ctx.outputs[key] = list(outs)
                if stage.is_last:
                    ctx.losses[mb] = outs[len(stage.send)]
            elif a.kind == SEND_F:
                _send(ctx.outputs[key][: len(stage.send)], self.rank_of_stage(s + 1), _tag(s + 1, mb, False, n), ctx.works)
            elif a.kind == RECV_B:
                metas = [(b.shape, b.dtype) for b in stage.send if b.requires_grad]
                ctx.grads[key] = _recv(metas, self.rank_of_stage(s + 1), _tag(s, mb, True, n), self.device)
            elif a.kind == B:
                before_backward(mb)
                if stage.is_last:
                    (ctx.losses[mb] / m).backward()
                else:
                    outs = [o for o, b in zip(ctx.outputs[key], stage.send) if b.requires_grad]
                    pairs = [(o, g) for o, g in zip(outs, ctx.grads.pop(key)) if o.requires_grad]
                    if pairs:
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                del ctx.outputs[key]
            elif a.kind == SEND_B:
                grads = [t.grad if t.grad is not None else torch.zeros_like(t)
                         for t, b in zip(ctx.inputs[key], stage.recv) if b.requires_grad]
                _send(grads, self.rank_of_stage(s - 1), _tag(s - 1, mb, True, n), ctx.works)
            if a.kind == SEND_B:
                del ctx.inputs[key]
            if a.kind == F:
                held = sum(1 for k in ctx.outputs if k[0] == s)
                self.peak_in_flight[s] = max(self.peak_in_flight[s], held)
            self.timeline.append((str(a), start, time.perf_counter()))
        for work, _ in ctx.works:
            work.wait()
        if not ctx.losses:
            return None
        return torch.stack([ctx.losses[i].detach() for i in range(m)]).double().mean()

    def forward(self, stages: list[StageGraph], microbatches: list[list[Any]], state: dict,
                constants: dict) -> list[list[torch.Tensor]] | None:
        """Forward only, microbatch by microbatch; the last stage's flat outputs per microbatch (else None)."""
        self.stages = stages
        n = len(self.stages)
        works: list = []
        results = []
        for mb, flat_inputs in enumerate(microbatches):
            for s in self.mine:
                stage = self.stages[s]
                recv = self._receive_forward(s, mb) if s > 0 else []
                outs = list(stage.gm(*self._args(stage, state, constants, flat_inputs, recv)))
                if stage.is_last:
                    results.append(outs[len(stage.send):])
                else:
                    _send(outs[: len(stage.send)], self.rank_of_stage(s + 1), _tag(s + 1, mb, False, n), works)
        for work, _ in works:
            work.wait()
        return results or None


def output_metas(stage: StageGraph) -> list[Boundary]:
    """Shapes and dtypes of the last stage's user outputs (for broadcasting them to every rank)."""
    node = next(nd for nd in stage.gm.graph.nodes if nd.op == "output")
    metas = []
    for arg in list(node.args[0])[len(stage.send):]:
        val = arg.meta["val"]
        metas.append(Boundary(arg.name, tuple(val.shape), val.dtype, False))
    return metas
