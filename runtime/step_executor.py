"""Step execution: one rank runs its step schedule's actions over its stage graphs.

Every run, pipelined or not, training or forward only, is a program of actions
(``autopar.core.step_schedule``): pipeline work (F, B, SEND/RECV) runs here;
the step's other actions (gradient reduction, ZeRO gathers, the optimizer, the
loss broadcast) call the ``StepHandlers`` the caller built from its rank state.

Shapes and dtypes of everything that crosses a cut are known from the graph,
so receive buffers are allocated up front and no shape handshake happens at
run time. Sends are non-blocking (``isend``; completed at the end of the step)
and receives block, the semantics ``autopar.core.simulate`` checks schedules under.
Every message has its own tag, so no ordering between messages is assumed.
Messages travel on the rank's ``wire`` device: its compute device, or the CPU
where the backend moves host memory only (gloo's send and receive), in which
case a message is copied to the CPU to be sent and back to the device when received.
A receive is posted one receive ahead: when a RECV action waits, the program's
next receive is already posted, so that message moves while this rank computes
(gloo moves a message once its receive is posted; posted only when needed, each
receive would cost a round trip on the critical path). At most one receive
buffer beyond the schedule's is held.
Microbatch losses are scaled by ``1/m`` so the accumulated gradients are those
of the mean loss over the rank's batch.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from autopar.core import weight_grad
from autopar.core.graph import Boundary, SlotKind, StageGraph
from autopar.core.schedule import (
    B, BROADCAST_LOSS, BROADCAST_OUTPUTS, F, OPTIMIZER, W, RECV_B, RECV_F, REDUCE_GRAD, REDUCE_SHARED, RESHARD, SEND_B,
    SEND_F, UNSHARD, Action,
)
from autopar.core.step_schedule import last_backwards
from autopar.runtime.regather import forward_run


def _tag(stage: int, microbatch: int, backward: bool, n_stages: int) -> int:
    return (microbatch * n_stages + stage) * 2 + int(backward)


def _send(tensors: list[torch.Tensor], dst: int, tag: int, works: list, wire: torch.device) -> None:
    for i, t in enumerate(tensors):
        t = t.detach()
        t = (t.to(torch.uint8) if t.dtype == torch.bool else t).to(wire).contiguous()
        works.append((dist.isend(t, dst, tag=tag * 64 + i), t))


@dataclass
class _Posted:
    """The receives in flight for one RECV action: its buffers (bool travels as uint8) and their works."""

    wires: list[torch.Tensor]
    works: list
    dtypes: list[torch.dtype]
    device: torch.device  # where the received tensors are used

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return [w.to(self.device).to(d) for w, d in zip(self.wires, self.dtypes)]


def _post_recv(metas: list[tuple[tuple[int, ...], torch.dtype]], src: int, tag: int, wire: torch.device,
               device: torch.device) -> _Posted:
    wires = [torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=wire)
             for shape, dtype in metas]
    works = [dist.irecv(w, src, tag=tag * 64 + i) for i, w in enumerate(wires)]
    return _Posted(wires, works, [dtype for _, dtype in metas], device)


@dataclass
class StepHandlers:
    """What this rank does for the step actions that are not pipeline work (``autopar.rank.step`` builds them).

    ``arm`` is called before every ``B`` with whether it is the stage's last
    before ``REDUCE_GRAD`` (gradient hooks may launch reductions during it).
    ``broadcast_loss`` gets the mean loss on the rank holding the last stage
    (None elsewhere) and returns the global one; ``broadcast_outputs`` gets
    the last stage's flat outputs per microbatch (None elsewhere) and returns
    what ``pm(x)`` returns.
    """

    arm: Callable[[bool], None] = lambda last: None
    unshard: Callable[[int], None] = lambda stage: None
    reshard: Callable[[int], None] = lambda stage: None
    reduce_grad: Callable[[], None] = lambda: None
    reduce_shared: Callable[[], None] = lambda: None
    optimizer: Callable[[], None] = lambda: None
    broadcast_loss: Callable[[torch.Tensor | None], Any] = lambda loss: loss
    broadcast_outputs: Callable[[list[list[torch.Tensor]] | None], Any] = lambda outs: outs


@dataclass
class _Ctx:
    inputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    results: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # forward: the last stage's outputs
    works: list = field(default_factory=list)
    training: bool = True  # the program has backward actions
    split: bool = False  # backwards are split: B leaves weight gradients to W
    deferred: dict[tuple[int, int], weight_grad.WeightGradients] = field(default_factory=dict)
    posted: dict[Action, _Posted] = field(default_factory=dict)  # receives posted ahead of their RECV action
    next_recv: dict[Action, Action] = field(default_factory=dict)  # RECV -> the program's next RECV
    returned: Any = None


class Executor:
    """Runs one rank's program of a step schedule (``autopar.core.step_schedule``) over its stage graphs.

    ``global_rank_of_stage(s)`` is the global rank holding stage ``s`` with this
    rank's dp and tp coordinates; ``device`` is where the rank computes, ``wire``
    where its messages travel (default ``device``). ``regather``: forwards save sequence parallelism's
    gathered activations as their shards (``runtime/regather.py``).
    """

    def __init__(self, global_rank_of_stage: Callable[[int], int], device: torch.device,
                 wire: torch.device | None = None, regather: bool = False) -> None:
        self.rank_of_stage = global_rank_of_stage
        self.device = device
        self.wire = wire or device
        self.regather = regather
        self.stages: list[StageGraph] = []
        self.timeline: list[tuple[str, float, float]] = []  # (action, start, end) of the last run, perf_counter s
        self.peak_in_flight: dict[int, int] = {}  # stage -> most microbatches held between F and B, last run
        self.kept = weight_grad.KeptGradients()  # W's gradient tensors, kept resident from one step to the next

    def _args(self, stage: StageGraph, state: dict, constants: dict, flat_inputs: list, recv: list) -> list:
        it = iter(recv)
        return [
            flat_inputs[s.index] if s.kind is SlotKind.INPUT else next(it) if s.kind is SlotKind.RECV
            else constants[s.name] if s.kind is SlotKind.CONSTANT else state[s.name]
            for s in stage.slots
        ]

    def _post(self, a: Action) -> _Posted:
        s, mb, n = a.stage, a.microbatch, len(self.stages)
        if a.kind == RECV_F:
            metas = [(b.shape, b.dtype) for b in self.stages[s].recv]
            return _post_recv(metas, self.rank_of_stage(s - 1), _tag(s, mb, False, n), self.wire, self.device)
        metas = [(b.shape, b.dtype) for b in self.stages[s].send if b.requires_grad]
        return _post_recv(metas, self.rank_of_stage(s + 1), _tag(s, mb, True, n), self.wire, self.device)

    def _receive(self, a: Action, ctx: _Ctx) -> list[torch.Tensor]:
        """Waits for RECV ``a`` (posting it if it is not yet), after posting the program's next receive."""
        posted = ctx.posted.pop(a, None) or self._post(a)
        following = ctx.next_recv.get(a)
        if following is not None and following not in ctx.posted:
            ctx.posted[following] = self._post(following)
        self.kept.prepare()  # (at the step's first receive, which waits for the pipeline to fill; then a no-op)
        got = posted.wait()
        if a.kind == RECV_F:
            return [t.requires_grad_(b.requires_grad) for t, b in zip(got, self.stages[a.stage].recv)]
        return got

    def run(self, program: Sequence[Action], stages: list[StageGraph], microbatches: list[list[Any]], state: dict,
            constants: dict, handlers: StepHandlers) -> Any:
        """Runs ``program``; returns what its ``BROADCAST_LOSS`` or ``BROADCAST_OUTPUTS`` returned."""
        self.stages = stages
        ctx = _Ctx(training=any(a.kind == B for a in program), split=any(a.kind == W for a in program))
        receives = [a for a in program if a.kind in (RECV_F, RECV_B)]
        ctx.next_recv = dict(zip(receives, receives[1:]))
        armed = last_backwards(program)
        self.timeline = []
        self.peak_in_flight = {a.stage: 0 for a in program if a.kind == F}
        for a in program:
            start = time.perf_counter()
            if a.is_compute or a.is_comm:
                self._pipeline_action(a, ctx, microbatches, state, constants, handlers, a in armed)
            else:
                self._step_action(a, ctx, len(microbatches), handlers)
            self.timeline.append((str(a), start, time.perf_counter()))
        return ctx.returned

    def _pipeline_action(self, a: Action, ctx: _Ctx, microbatches: list[list[Any]], state: dict, constants: dict,
                         handlers: StepHandlers, last: bool) -> None:
        key = (a.stage, a.microbatch)
        _PIPELINE_ACTIONS[a.kind](self, a, ctx, microbatches, state, constants, handlers, last)
        if a.kind == B or (a.kind == SEND_F and not ctx.training):
            del ctx.outputs[key]  # (forward only: nothing comes back for it)
        if a.kind == SEND_B or (a.kind == F and not ctx.training):
            ctx.inputs.pop(key, None)

    def _recv_f(self, a: Action, ctx: _Ctx, *_: Any) -> None:
        ctx.inputs[(a.stage, a.microbatch)] = self._receive(a, ctx)

    def _recv_b(self, a: Action, ctx: _Ctx, *_: Any) -> None:
        ctx.grads[(a.stage, a.microbatch)] = self._receive(a, ctx)

    def _forward(self, a: Action, ctx: _Ctx, microbatches: list[list[Any]], state: dict, constants: dict,
                 *_: Any) -> None:
        s, mb, stage = a.stage, a.microbatch, self.stages[a.stage]
        key = (s, mb)
        if s > 0 and key not in ctx.inputs and self.rank_of_stage(s - 1) == self.rank_of_stage(s):
            ctx.inputs[key] = self._hand_over(ctx, s, mb)
        with forward_run(self.regather and ctx.training):
            outs = list(stage.gm(*self._args(stage, state, constants, microbatches[mb], ctx.inputs.get(key, []))))
        k = len(stage.mutated)
        with torch.no_grad():
            for name, value in zip(stage.mutated, outs[:k]):
                state[name].copy_(value)
        outs = outs[k:]
        if stage.is_last and ctx.training:
            ctx.losses[mb] = outs[len(stage.send)]
        elif stage.is_last:
            ctx.results[mb] = outs[len(stage.send):]
        if ctx.training or not stage.is_last:
            ctx.outputs[key] = outs
        held = len({k for k in [*ctx.outputs, *ctx.deferred] if k[0] == s})  # (W still needs a B's inputs)
        self.peak_in_flight[s] = max(self.peak_in_flight[s], held)

    def _send_f(self, a: Action, ctx: _Ctx, *_: Any) -> None:
        s, mb, stage = a.stage, a.microbatch, self.stages[a.stage]
        _send(ctx.outputs[(s, mb)][: len(stage.send)], self.rank_of_stage(s + 1), _tag(s + 1, mb, False,
              len(self.stages)), ctx.works, self.wire)

    def _backward_input(self, a: Action, ctx: _Ctx, microbatches: list[list[Any]], state: dict, constants: dict,
                        handlers: StepHandlers, last: bool) -> None:
        s, mb, stage = a.stage, a.microbatch, self.stages[a.stage]
        key = (s, mb)
        if not stage.is_last and key not in ctx.grads:  # the next stage is on this rank too
            ctx.grads[key] = _input_grads(ctx.inputs.pop((s + 1, mb)), self.stages[s + 1])
        handlers.arm(last)
        with weight_grad.collect() if ctx.split else contextlib.nullcontext() as deferred:
            self._backward(ctx, stage, key, len(microbatches))
        if deferred is not None:
            ctx.deferred[key] = deferred

    def _backward_weight(self, a: Action, ctx: _Ctx, microbatches: list[list[Any]], state: dict, constants: dict,
                         handlers: StepHandlers, last: bool) -> None:
        handlers.arm(last)
        ctx.deferred.pop((a.stage, a.microbatch)).run(self.kept)

    def _send_b(self, a: Action, ctx: _Ctx, *_: Any) -> None:
        s, mb = a.stage, a.microbatch
        _send(_input_grads(ctx.inputs[(s, mb)], self.stages[s]), self.rank_of_stage(s - 1),
              _tag(s - 1, mb, True, len(self.stages)), ctx.works, self.wire)

    def _hand_over(self, ctx: _Ctx, s: int, mb: int) -> list[torch.Tensor]:
        """Stage ``s - 1``'s outputs as stage ``s``'s inputs on one rank: detached, as if received, so that
        ``B(s)`` ends at them and ``B(s - 1)`` starts from their gradients."""
        previous = self.stages[s - 1]
        sent = ctx.outputs[(s - 1, mb)][: len(previous.send)]
        if not ctx.training:
            del ctx.outputs[(s - 1, mb)]
        return [t.detach().requires_grad_(b.requires_grad) for t, b in zip(sent, self.stages[s].recv)]

    @staticmethod
    def _backward(ctx: _Ctx, stage: StageGraph, key: tuple[int, int], m: int) -> None:
        if stage.is_last:
            (ctx.losses[key[1]] / m).backward()
            ctx.losses[key[1]] = ctx.losses[key[1]].detach()  # (its graph would keep the received inputs alive)
            return
        outs = [o for o, b in zip(ctx.outputs[key], stage.send) if b.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, ctx.grads.pop(key)) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    def _step_action(self, a: Action, ctx: _Ctx, m: int, handlers: StepHandlers) -> None:
        if a.kind in (REDUCE_GRAD, BROADCAST_LOSS, BROADCAST_OUTPUTS):  # sends complete before the collectives
            for work, _ in ctx.works:
                work.wait()
            ctx.works.clear()
        _STEP_ACTIONS[a.kind](self, a, ctx, m, handlers)

    def _broadcast_loss(self, ctx: _Ctx, m: int, handlers: StepHandlers) -> None:
        loss = torch.stack([ctx.losses[i].detach() for i in range(m)]).double().mean() if ctx.losses else None
        ctx.returned = handlers.broadcast_loss(loss)

    def _broadcast_outputs(self, ctx: _Ctx, m: int, handlers: StepHandlers) -> None:
        ctx.returned = handlers.broadcast_outputs([ctx.results[i] for i in range(m)] if ctx.results else None)


# what each kind of action does (``Kind`` in autopar/core/schedule.py): pipeline actions, then the step's own
_PIPELINE_ACTIONS = {
    RECV_F: Executor._recv_f, F: Executor._forward, SEND_F: Executor._send_f,
    RECV_B: Executor._recv_b, B: Executor._backward_input, W: Executor._backward_weight, SEND_B: Executor._send_b,
}
_STEP_ACTIONS = {
    UNSHARD: lambda ex, a, ctx, m, h: h.unshard(a.stage),
    RESHARD: lambda ex, a, ctx, m, h: h.reshard(a.stage),
    REDUCE_GRAD: lambda ex, a, ctx, m, h: h.reduce_grad(),
    REDUCE_SHARED: lambda ex, a, ctx, m, h: h.reduce_shared(),
    OPTIMIZER: lambda ex, a, ctx, m, h: ex.kept.through(h.optimizer),
    BROADCAST_LOSS: lambda ex, a, ctx, m, h: ex._broadcast_loss(ctx, m, h),
    BROADCAST_OUTPUTS: lambda ex, a, ctx, m, h: ex._broadcast_outputs(ctx, m, h),
}


def _input_grads(inputs: list[torch.Tensor], stage: StageGraph) -> list[torch.Tensor]:
    """The gradients of a stage's inputs that need one (zeros where backward produced none)."""
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t, b in zip(inputs, stage.recv) if b.requires_grad]


def output_metas(stage: StageGraph) -> list[Boundary]:
    """Shapes and dtypes of the last stage's user outputs (for broadcasting them to every rank)."""
    node = next(nd for nd in stage.gm.graph.nodes if nd.op == "output")
    metas = []
    for arg in list(node.args[0])[len(stage.send):]:
        val = arg.meta["val"]
        metas.append(Boundary(arg.name, tuple(val.shape), val.dtype, False))
    return metas
