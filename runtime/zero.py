"""ZeRO stages 1-3 over the dp axis on one rank: flat shards, gradient reduction, the sharded optimizer step.

Under hybrid sharding (``Mesh(dp=(replicate, shard))``) the shards are over the
rank's ``dp_shard`` group, and each shard's gradient is all-reduced over its
``dp_replicate`` group (the ranks holding the same slice) as soon as a
reduction issued in its stage's last backward action (``arm(last=True)``: no
gradient of the stage comes after it) has landed, beside the rest of backward;
a group that action does not reduce is all-reduced in ``finish``.

``ZeroRuntime`` acts only on the rank's own parameter tensors and its dp process
group, so a pipeline rank (its stage's parameters) or a tensor-parallel rank
(its parameter shards) uses it unchanged. It plugs into ``ParallelModel.step``
where data parallelism's gradient sync does: ``arm(last)`` before each backward, ``finish()`` after the
microbatches, then the user's optimizer, built on the shards, steps; a step
post-hook all-gathers the updated shards (stages 1-2) and takes the memory account.

Invariant: after every step each rank's full parameters (stages 1-2) or shards
(stage 3) equal the matching elements of single-device training on the global
batch, because each shard receives the dp-averaged gradient of its elements
and the optimizer is elementwise (checked by ``check_optimizer``).
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from autopar.core.collectives import Binding
from autopar.core.graph import tied_aliases
from autopar.core.optimizers import OPTIMIZERS
from autopar.core.zero_layout import ZeroLayout, zero_layout
from autopar.runtime import zero_kernels as _kernels  # noqa: F401  (runs the autopar::zero_* ops of stage-3 graphs)
from autopar.runtime.groups import Groups
from autopar.runtime.master import Masters, build_optimizer
from autopar.runtime.memory import MemoryAccount
from autopar.runtime.zero_group import FlatShard, GatheredBytes, ReduceQueue, ReplicaReduce
from autopar.runtime.zero_trace import ZeroTrace
from autopar.runtime.zero_untouched import HeldElements, StepCounts, local_spans

# optimizers whose update of an element reads only that element's parameter, gradient and state
def check_optimizer(factory: Callable[[list], Any] | None, params: list[torch.Tensor], stage: int) -> None:
    """Raises unless ``factory(params)`` is an elementwise optimizer with one parameter group of ``params``."""
    if factory is None:
        return
    opt = factory(params)
    cls = type(opt)
    elementwise = OPTIMIZERS[cls].elementwise if cls in OPTIMIZERS else bool(getattr(cls, "elementwise", False))
    if not elementwise:
        names = ", ".join(c.__name__ for c, kind in OPTIMIZERS.items() if kind.elementwise)
        raise ValueError(
            f"zero={stage} steps each rank's shard of the flattened parameters, so the optimizer must update every "
            f"element from that element alone; {cls.__name__} is not known to be elementwise (it would see "
            f"flat shards, not whole parameters, and compute a wrong update). Use one of {names}, or zero=0; "
            "an elementwise optimizer class of your own can declare `elementwise = True`"
        )
    groups = opt.param_groups
    given = {id(p) for p in params}
    others = sum(id(p) not in given for g in groups for p in g["params"])
    if others:
        raise ValueError(
            f"the optimizer factory built {cls.__name__} on {others} parameter(s) it was not given: it must use its "
            f"argument (lambda params: torch.optim.AdamW(params, lr=1e-3)), not the model's parameters "
            f"(lambda params: torch.optim.AdamW(model.parameters())): zero={stage} passes it the flat shards each "
            "rank steps, and an optimizer on the model's own tensors would never see their gradients"
        )
    if len(groups) != 1 or len(groups[0]["params"]) != len(params):
        sizes = [len(g["params"]) for g in groups]
        raise ValueError(
            f"zero={stage} builds the optimizer on flat shards with one parameter group, but the optimizer factory "
            f"made {len(groups)} groups of {sizes} parameters from {len(params)}; per-parameter settings are lost "
            "on flat shards. Build the optimizer with one group (e.g. lambda params: torch.optim.AdamW(params, "
            "lr=1e-3)) or use zero=0"
        )


@dataclass(frozen=True)
class ZeroSettings:
    """What ZeRO reads of the parallelization options."""

    stage: int  # 1, 2 or 3
    bucket_bytes: int  # gradients reduced in buckets of about this size (``core/buckets.py``)
    optimizer: Callable[[list], torch.optim.Optimizer] | None = None  # the user's factory, built on the shards
    reduce_dtype: torch.dtype | None = None  # mixed precision: gradients reduced in this dtype

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage {self.stage!r}: pass zero=1, 2 or 3 (or zero=0 for no sharding)")


class ZeroRuntime:
    """The ZeRO state of one rank; see the module docstring for how ``ParallelModel`` drives it."""

    def __init__(self, model: torch.nn.Module, groups: Groups, settings: ZeroSettings,
                 params: list[torch.nn.Parameter], alone: set[str] | frozenset[str] = frozenset(),
                 values: dict[str, torch.Tensor] | None = None, binding: Binding | None = None,
                 routed: frozenset[str] = frozenset()) -> None:
        """Shards ``params`` (this rank's trainable parameters of ``model``) over ``groups[mesh.zero_axis]``
        (dp, or dp_shard under hybrid sharding).

        Each parameter named in ``alone`` (held by several pipeline ranks) gets a flat group of its own.
        ``binding``: the rank's (``core/collectives.py``), which counts ZeRO's collectives and through which the
        stage-3 graph ops find each shard's group.
        ``values`` (``precision="mixed"``): the parameters' float32 values, from which each shard's master
        is cut for the optimizer to step (``runtime/master.py``).
        ``routed`` (expert parallelism): the routed experts' parameters, sharded over ``mesh.expert_zero_axis``
        (the ranks holding the same experts, inside one replica under hybrid sharding); their gradients are
        summed there and divided by dp (by dp_shard, before the average over replicas), since each holder's
        gradient already sums the tokens of its ep group.
        """
        mesh = groups.mesh
        axis = mesh.zero_axis
        self.model = model
        self.groups = groups
        self.stage = settings.stage
        # parameters the running program sends no gradient to: stages 1-2 see those that got one from autograd's
        # hooks, stage 3 reduces whole layers in its graph, so the step sets them (``autopar/rank/step.py``); the
        # optimizer step leaves both kinds untouched (``runtime/zero_untouched.py``)
        self.unused: frozenset[str] = frozenset()
        self.alone = frozenset(alone)
        self._got: set[int] = set()  # stages 1-2: the parameters that got a gradient this step (by id)
        self._held = HeldElements()
        self._counts = StepCounts()
        self._armed = True  # stage 1: reduce the gradients of the stage's last microbatch only (``arm``)
        mine = {id(p) for p in params}
        named = [(n, p) for n, p in model.named_parameters() if id(p) in mine]
        self.layout: ZeroLayout = zero_layout([(n, tuple(p.shape), p.dtype) for n, p in named], stage=self.stage,
                                              n=mesh[axis], bucket_bytes=settings.bucket_bytes, alone=alone,
                                              routed=routed, routed_n=mesh[mesh.expert_zero_axis],
                                              routed_axis=mesh.expert_zero_axis)
        check_optimizer(settings.optimizer, [p for _, p in named], self.stage)
        self.tracker = GatheredBytes()
        self.trace = ZeroTrace()  # each layer's gathers, reductions and backward, for pm.timeline(layers=True)
        replicate = groups["dp_replicate"] if mesh.dp_replicate > 1 else None
        self.replicas = ReplicaReduce(replicate, mesh.dp_replicate, self.trace) if replicate is not None else None
        self.queue = ReduceQueue(trace=self.trace, replicas=self.replicas)
        by_name = dict(named)
        self.shards: list[FlatShard] = []
        self.members: dict[FlatShard, list[torch.nn.Parameter]] = {}
        for spec in self.layout.groups:
            on = spec.axis or axis
            fs = FlatShard(spec, index=groups.coord(on), group=groups[on] if mesh[on] > 1 else None,
                           ranks=mesh.group_of(groups.rank, on), device=groups.device, stage=self.stage,
                           tracker=self.tracker, queue=self.queue, reduce_dtype=settings.reduce_dtype, trace=self.trace,
                           axis=on, binding=binding,
                           divisor=mesh.dp // mesh.dp_replicate if spec.axis else None)
            members = [by_name[n] for n in spec.params]
            fs.load_full(members)
            self._adopt(fs, members)
            self.shards.append(fs)
            self.members[fs] = members
        self.state: dict[str, torch.Tensor] = dict(model.named_parameters()) | dict(model.named_buffers())
        if self.stage == 3:
            for fs in self.shards:
                self.state.update(dict.fromkeys(fs.spec.params, fs.shard))
        if binding is not None:
            binding.shards.update({id(fs.shard): fs for fs in self.shards})
        self.params = [fs.shard for fs in self.shards]
        self.masters: Masters | None = None
        if values is not None:  # (kept without an optimizer too: the state is the fp32 values)
            self.masters = Masters(self.params, [fs.local_flat([values[n] for n in fs.spec.params], torch.float32)
                                                 for fs in self.shards])
        self.optimizer = build_optimizer(settings.optimizer, self.params, self.masters)
        if self.optimizer is not None:
            self.optimizer.register_step_pre_hook(self._before_step)
            self.optimizer.register_step_post_hook(self._after_step)
        self._group_of = {id(p): fs for fs, members in self.members.items() for p in members}
        self._ready: Counter[FlatShard] = Counter()
        self._hits: Counter[FlatShard] = Counter()
        self._launched: set[FlatShard] = set()
        if self.stage < 3:
            for p in self.owned_parameters():
                p.register_post_accumulate_grad_hook(self._on_grad)
        self.memory = MemoryAccount(self._parameter_tensors, self._gradient_tensors, self.optimizer,
                                    (lambda: self.tracker.peak) if self.stage == 3 else None, on_step=False)

    def shard_of(self, name: str) -> torch.nn.Parameter:
        """The flat shard of the group holding parameter ``name``."""
        return next(fs.shard for fs in self.shards if name in fs.spec.params)

    def owned_parameters(self) -> list[torch.nn.Parameter]:
        """The model parameters this runtime shards (this rank's trainable ones), in layout order."""
        return [p for members in self.members.values() for p in members]

    def _adopt(self, fs: FlatShard, members: list[torch.nn.Parameter]) -> None:
        """Points the model's parameters at the flat buffers (stages 1-2) or frees them (stage 3)."""
        if self.stage < 3:
            for p, view in zip(members, fs.views(fs.full)):
                p.data = view
            if self.stage == 1:
                for p, view in zip(members, fs.views(fs.grad_full)):
                    p.grad = view  # autograd accumulates in place into the flat gradient
        else:
            for p in members:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    # gradient sync (the interface of runtime.grad_sync.BucketedAllReduce) ----------
    def arm(self, last: bool) -> None:
        """Whether the next backward (B or W) is its stage's last action that computes gradients before the step's
        reduction (``last``). Stage 1 reduces only then (full gradients accumulate until then); stages 2-3 reduce
        every microbatch's. A reduction issued in it is its group's final one of the step (hybrid sharding: the
        all-reduce across replicas follows it)."""
        self._armed = last
        self.queue.final = last

    def _on_grad(self, p: torch.Tensor) -> None:
        self._got.add(id(p))
        fs = self._group_of[id(p)]
        self._hits[fs] += 1
        if self.stage == 1 and not self._armed:
            return  # stage 1 keeps full gradients: reduce once, after the last microbatch
        self._ready[fs] += 1
        if self._ready[fs] >= len(self.members[fs]):
            self._launch(fs)

    def _launch(self, fs: FlatShard) -> None:
        self._ready[fs] = 0
        if self.stage == 1:
            self._launched.add(fs)
            self.queue.reduce_scatter_in_place(fs)
            return
        members = self.members[fs]
        if all(p.grad is None for p in members):
            return
        pieces = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in members]
        pad = fs.spec.padded - fs.spec.numel
        if pad:
            pieces.append(members[0].new_zeros(pad))
        flat = torch.cat(pieces)  # (padded,)
        for p in members:
            p.grad = None  # stage 2 keeps no full gradient
        fs.reduce_gradient(flat, owned=True)

    def finish(self) -> None:
        """Reduces what backward left, waits, averages over replicas (hybrid sharding), and hands each shard its
        averaged gradient (None if it got none)."""
        for fs in self.shards:
            if self.stage == 1 and fs not in self._launched and self._hits[fs]:
                self._launch(fs)
            elif self.stage == 2 and any(p.grad is not None for p in self.members[fs]):
                self._launch(fs)
        self.queue.drain()
        if self.replicas is not None:
            self.replicas.finish(self.shards)
        self.queue.final = False
        for fs in self.shards:
            fs.shard.grad = None if fs.fresh else fs.grad
        self._ready.clear()
        self._hits.clear()
        self._launched.clear()

    def _without_gradient(self, fs: FlatShard) -> list[int]:
        """Positions in ``fs``'s group of the parameters that got no gradient this step (on every rank alike)."""
        if self.stage == 3:
            return [i for i, name in enumerate(fs.spec.params) if name in self.unused]
        return [i for i, p in enumerate(self.members[fs]) if id(p) not in self._got]

    def _before_step(self, *_: Any) -> None:
        """Holds the elements of parameters without a gradient in the shards the optimizer steps: on one device
        their ``grad`` is None and the optimizer skips them, here their zeros sit in a stepped flat shard."""
        for fs in self.shards:
            if fs.shard.grad is None or self.alone.issuperset(fs.spec.params):
                continue  # (skipped by the optimizer; a parameter of several pp ranks has their summed gradient)
            stepped = self.masters.of(fs.shard) if self.masters is not None else fs.shard
            tensors = [fs.shard] if stepped is fs.shard else [fs.shard, stepped]
            without = self._without_gradient(fs)
            self._held.hold(self.optimizer, tensors, stepped, local_spans(fs.spec, fs.index, without))
            self._counts.record(list(fs.spec.params), set(without), "step" in self.optimizer.state.get(stepped, {}))

    def _after_step(self, *_: Any) -> None:
        self._held.restore(self.optimizer)
        self._got.clear()
        works = [fs.all_gather_in_place() for fs in self.shards] if self.stage < 3 else []
        for work in works:
            if work is not None:
                work.wait()
        self.memory.snapshot()  # the steady state: parameters, gradients and optimizer state all exist
        self.tracker.reset_peak()
        for fs in self.shards:
            fs.fresh = True
            fs.drop_prefetch()
            if fs.grad_full is not None:
                fs.grad_full.zero_()
                for p, view in zip(self.members[fs], fs.views(fs.grad_full)):
                    p.grad = view
            else:
                fs.grad = None  # freed with the optimizer's zero_grad(set_to_none=True)

    # stage 3: the UNSHARD / RESHARD actions of a step ------------------------------
    def prefetch_first(self, gm: torch.fx.GraphModule, slots: list) -> None:
        """Starts gathering the first layer ``gm`` gathers, so that it overlaps what runs before the graph."""
        gather = torch.ops.autopar.zero_all_gather.default
        node = next((n for n in gm.graph.nodes if n.target is gather), None)
        if node is None:
            return
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        name = slots[placeholders.index(node.args[0])].name
        dtype = node.args[3] if len(node.args) > 3 else node.kwargs.get("dtype")  # what the graph gathers in
        next(fs for fs in self.shards if name in fs.spec.params).prefetch(dtype)

    def drop_pending(self, params: list[str]) -> None:
        """Completes and drops the pending gathers of the groups holding ``params`` (a stage's parameters)."""
        names = set(params)
        for fs in self.shards:
            if names.intersection(fs.spec.params):
                fs.drop_prefetch()

    # full state ----------------------------------------------------------------
    def full_parameters(self, *, masters: bool = False) -> dict[str, torch.Tensor]:
        """Every sharded parameter at full size (stage 3 all-gathers over the ZeRO group: every rank calls this);
        with ``masters``, the float32 masters where the optimizer keeps them (all-gathered at every stage)."""
        out = {}
        for fs in self.shards:
            if masters and self.masters is not None:
                full = fs.gather_from(self.masters.of(fs.shard))
            else:
                full = fs.full if fs.full is not None else fs.gather()
            out.update(zip(fs.spec.params, fs.views(full)))
        return out

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads a full state (the model's keys, e.g. from ``state_dict()`` on any mesh) into the shards."""
        aliases = tied_aliases(self.model)
        expected = set(self.model.state_dict().keys())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise KeyError(f"the state does not match the model: missing {missing[:5]} ({len(missing)} in all), "
                           f"unexpected {unexpected[:5]} ({len(unexpected)} in all); pass a full state_dict() of "
                           "this model (pm.state_dict() on any mesh, or the single-device model's)")
        for fs in self.shards:
            values = [state[name] for name in fs.spec.params]
            fs.load_full(values)
            if self.masters is not None:
                with torch.no_grad():
                    self.masters.of(fs.shard).copy_(fs.local_flat(values, torch.float32))
        sharded = {name for fs in self.shards for name in fs.spec.params}
        with torch.no_grad():
            for key, value in self.model.state_dict(keep_vars=True).items():
                if aliases.get(key, key) not in sharded and key in state:
                    value.copy_(state[key])

    @contextmanager
    def full_size_parameters(self) -> Iterator[None]:
        """Stage 3: gives the model's parameters full-size (uninitialised) storage while a capture reads shapes."""
        if self.stage < 3:
            yield
            return
        for fs in self.shards:
            for p, shape in zip(self.members[fs], fs.spec.shapes):
                p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
        try:
            yield
        finally:
            for fs in self.shards:
                for p in self.members[fs]:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    # memory ----------------------------------------------------------------------
    def _parameter_tensors(self) -> list[torch.Tensor]:
        frozen = [p for p in self.model.parameters() if not p.requires_grad]  # (other stages' are empty)
        return [*self.owned_parameters(), *self.params, *frozen]

    def _gradient_tensors(self) -> list[torch.Tensor | None]:
        return [*(p.grad for p in self.owned_parameters()), *(fs.grad for fs in self.shards),
                *(fs.grad_full for fs in self.shards)]
