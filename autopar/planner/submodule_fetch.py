"""ZeRO-3 gathered per submodule, as DeepSpeed's ZeRO-3 of 2021 runs it (its
``PartitionedParameterCoordinator`` of v0.3.12-v0.3.13): ``step_program``'s
``DataParallelPlan.fetch``.

Per parameter of at least ``persistence`` elements (smaller ones stay gathered after the first step and are
left out). The step's trace is every submodule use in order: forward, then per unit in reverse its recomputed
forward (under full recomputation) and its backward, submodules in reverse. At each use: the parameters not
gathered are gathered, and if any was gathered or is in flight the host waits for every in-flight gather and
for the device (``torch.cuda.synchronize``); then, if no gather is in flight and fewer than ``max_live``
elements are gathered, the next not-gathered parameters in the trace are prefetched until they reach
``prefetch_bucket`` elements; every gather first waits for the device (``_allgather_param``'s synchronize:
compute and every collective issued, reduce-scatters too). After the use a parameter is released unless the
trace uses its submodule again within ``max_reuse`` elements of other submodules' parameters. A parameter's
gradient is reduce-scattered after its last backward use in the microbatch (one reduction in flight, as
``reduce_ipg_grads`` waits). A unit's compute is split among its submodules by their elements. With
``hold_shared``, the parameters several units use (a tied embedding) are the model's external parameters
(Megatron-LM's ZeRO-3 GPT registers its word embeddings so): the model's forward and backward pre-hooks are
uses too, and they stay gathered until the microbatch's backward ends. There every parameter still gathered is
released (``_partition_all_parameters``: the post-backward hook of a module whose inputs need no gradient
never fires).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.planner.step_sim import Kind


@dataclass(frozen=True)
class Submodule:
    """A module whose parameters ZeRO-3 gathers together when it runs (``SubmoduleFetch``)."""

    key: str  # the module (one key for a module several units use)
    params: tuple[int, ...]  # its gathered parameters: indices into ``DataParallelPlan.gather``
    share: float  # its share of the unit's compute


@dataclass(frozen=True)
class SubmoduleFetch:
    """ZeRO-3 gathering each submodule's parameters as it runs, as DeepSpeed's 2021 coordinator does (the module
    doc); elements, DeepSpeed's defaults (``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``,
    ``stage3_max_reuse_distance``, ``stage3_param_persistence_threshold``)."""

    prefetch_bucket: int = 50_000_000
    max_live: int = 1_000_000_000
    max_reuse: int = 1_000_000_000
    persistence: int = 100_000
    hold_shared: bool = True  # parameters several units use are the model's external parameters (see the doc)


_RELEASED, _IN_FLIGHT, _GATHERED = 0, 1, 2


class Coordinator:
    """ZeRO-3 per submodule over a step's trace, as DeepSpeed's 2021 coordinator runs it (the module doc)."""

    def __init__(self, b: Any, units: list[Any], dp: Any, microbatches: int) -> None:
        """``b``: the step program's builder; ``units`` and ``dp``: its ``Unit`` list and ``DataParallelPlan``."""
        self.b, self.units, self.dp, self.fetch = b, units, dp, dp.fetch
        users: dict[int, set[int]] = {}
        for i, u in enumerate(units):
            for s in u.submodules:
                for p in s.params:
                    users.setdefault(p, set()).add(i)
        self.held = {p for p, us in users.items() if len(us) > 1} if dp.fetch.hold_shared else set()
        self.top = Submodule("model", tuple(sorted(self.held)), 0.0)
        top = [("model", -1, -1)] if self.held else []
        one = top + [("forward", i, j) for i, u in enumerate(units) for j in range(len(u.submodules))]
        one += [("model backward", -1, -1)] if self.held else []
        for i in reversed(range(len(units))):
            if dp.regathers == 2 and units[i].recomputed:
                one += [("recompute", i, j) for j in range(len(units[i].submodules))]
            one += [("backward", i, j) for j in reversed(range(len(units[i].submodules)))]
        self.trace = one * microbatches  # the trace spans the step (DeepSpeed resets it at the optimizer step)
        self.per = len(one)
        self.status = [_RELEASED] * len(dp.elements)
        self.live = 0  # elements gathered or in flight
        self.flying: list[int] = []  # parameters whose gathers are in flight
        self.reducing: list[int | None] = [None]
        self.last = {p: n for n, (what, i, j) in enumerate(one) if what == "backward"
                     for p in units[i].submodules[j].params}  # each parameter's gradient completes there
        self.keep = self._reuse()

    def _submodule(self, t: int) -> Submodule:
        what, i, j = self.trace[t]
        return self.top if what.startswith("model") else self.units[i].submodules[j]

    def _reuse(self) -> list[bool]:
        """Whether each use keeps its parameters: its submodule is used again within ``max_reuse`` elements of
        the submodules' parameters between (``_keep_for_later``)."""
        sizes = [sum(self.dp.elements[p] for p in self._submodule(t).params) for t in range(len(self.trace))]
        before = [0]
        for n in sizes:
            before.append(before[-1] + n)
        seen: dict[str, int] = {}
        keep = [False] * len(self.trace)
        for t in reversed(range(len(self.trace))):
            key = self._submodule(t).key
            if key in seen:
                keep[t] = before[seen[key]] - before[t + 1] < self.fetch.max_reuse
            seen[key] = t
        return keep

    def microbatch(self, k: int) -> None:
        """Microbatch ``k``'s events: each unit's submodules in the trace's order, its compute split by share."""
        t = k * self.per
        if self.held:  # the model's forward pre-hook fetches its external parameters
            self.use(t)
            t += 1
        for i, u in enumerate(self.units):
            t = self._pass(t, i, f"forward {i}", u.forward, u.tp_forward, range(len(u.submodules)))
        if self.held:  # ... and its backward pre-hook
            self.use(t)
            t += 1
        for i in reversed(range(len(self.units))):
            u = self.units[i]
            backward = u.backward
            if self.dp.regathers == 2 and u.recomputed and u.submodules:
                t = self._pass(t, i, f"backward {i}", u.forward, 0.0, range(len(u.submodules)))
                backward -= u.forward
            t = self._pass(t, i, f"backward {i}", backward, u.tp_backward, reversed(range(len(u.submodules))),
                           reduce=True)
        for p, status in enumerate(self.status):  # ``_partition_all_parameters`` after each backward
            if status == _GATHERED:
                self.status[p] = _RELEASED
                self.live -= self.dp.elements[p]

    def _pass(self, t: int, i: int, name: str, seconds: float, tp: float, order: Any, reduce: bool = False) -> int:
        """Unit ``i``'s submodules in ``order`` from trace step ``t`` (its whole compute when it has none); the
        trace step after them."""
        u = self.units[i]
        order = list(order)
        if not order:
            self.b.compute(name, seconds, tp)
            return t
        for n, j in enumerate(order):
            self.use(t)
            if reduce:  # as the host launches the backward (the reduction stream waited for no compute until 2022)
                self._reduce(t)
            self.b.compute(name, seconds * u.submodules[j].share, tp if n == len(order) - 1 else 0.0)
            self.release(t)
            t += 1
        return t

    def _reduce(self, t: int) -> None:
        """The reduce-scatters of the gradients trace step ``t`` completes, one in flight."""
        for p in self._submodule(t).params:
            if self.last[p] == t % self.per:
                if self.reducing[0] is not None:
                    self.b.wait((self.reducing[0],))
                name = self.dp.names[p] if self.dp.names else str(p)
                self.reducing[0] = self.b.collective(Kind.REDUCE_SCATTER, f"reduce_scatter {name}",
                                                     self.dp.reduce[p], self.dp.link)

    def _gather(self, p: int, kind: Kind) -> None:
        self.b.wait_all("synchronize")
        name = self.dp.names[p] if self.dp.names else str(p)
        self.b.collective(kind, f"{kind.value} {name}", self.dp.gather[p], self.dp.link)
        self.flying.append(p)
        self.status[p] = _IN_FLIGHT
        self.live += self.dp.elements[p]

    def use(self, t: int) -> None:
        """The submodule's fetch (gathering what it lacks, waiting if anything was), then the prefetch."""
        params = self._submodule(t).params
        lacking = [p for p in params if self.status[p] == _RELEASED]
        waits = any(self.status[p] == _IN_FLIGHT for p in params)
        for p in lacking:
            self._gather(p, self._kind(t))
        if lacking or waits:  # every gather in flight waited for, then the device
            self.b.wait_all("synchronize")
            for q in self.flying:
                self.status[q] = _GATHERED
            self.flying = []
        if self.flying or self.live >= self.fetch.max_live:  # a prefetch only with none in flight, under budget
            return
        chosen: dict[int, Kind] = {}  # the next parameters not gathered, and for which pass
        total = 0
        for n in range(t, len(self.trace)):
            for p in self._submodule(n).params:
                if self.status[p] == _RELEASED and p not in chosen:
                    chosen[p] = self._kind(n)
                    total += self.dp.elements[p]
                    if total >= self.fetch.prefetch_bucket:
                        break
            if total >= self.fetch.prefetch_bucket:
                break
        for p, kind in chosen.items():
            self._gather(p, kind)

    def _kind(self, t: int) -> Kind:
        return Kind.GATHER if self.trace[t][0] in ("forward", "model") else Kind.REGATHER

    def release(self, t: int) -> None:
        if self.keep[t]:
            return
        for p in self._submodule(t).params:
            if self.status[p] == _GATHERED and p not in self.held:
                self.status[p] = _RELEASED
                self.live -= self.dp.elements[p]
