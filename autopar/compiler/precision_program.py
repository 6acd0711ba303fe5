"""Mixed precision on a compiled program: every rank's graph cast as the policy says, the plan told its dtypes.

The policy itself, its checks and the capture in the compute dtype are ``autopar/precision.py``; the graph
rewrite is ``passes/mixed_precision.py``.
"""
from __future__ import annotations

import dataclasses

import torch

from autopar.compiler.program import Program
from autopar.core.comm import OPS
from autopar.core.graph import SlotKind
from autopar.passes.mixed_precision import cast_outputs, cast_placeholders
from autopar.precision import Policy, stored_dtype


def apply_to_program(program: Program, model: torch.nn.Module, pol: Policy, *, with_loss: bool) -> None:
    """Every graph of ``program`` takes its parameters and inputs as fed (float32 masters, the user's inputs)
    and casts them where they are used; a loss graph returns a float32 loss (``passes/mixed_precision.py``)."""
    params = {n: stored_dtype(p, pol) for n, p in model.named_parameters()}
    inputs = program.captured.input_dtypes
    for st in program.graphs.distinct():  # (tp indices may share a graph: each once)
        fed = []
        for slot in st.slots:
            if slot.kind is SlotKind.PARAM:
                fed.append(params.get(slot.name))
            elif slot.kind is SlotKind.INPUT:
                index = slot.index
                fed.append(inputs[index] if index < len(inputs) else None)
            else:
                fed.append(None)
        cast_placeholders(st.gm, fed)
        if with_loss and st.is_last:
            cast_outputs(st.gm, torch.float32, skip=len(program.captured.mutated_buffers))
    _describe_graphs(program, model, pol)


def _describe_graphs(program: Program, model: torch.nn.Module, pol: Policy) -> None:
    """The plan shows each parameter's dtypes, the dtypes of the tp collectives and of the pipeline's hops."""
    plan = program.plan
    params = dict(model.named_parameters())
    plan.precision = pol.describe()
    plan.params = [dataclasses.replace(p, dtypes=(stored_dtype(params[p.name], pol), pol.compute))
                   if params[p.name].is_floating_point() else p for p in plan.params]
    graphs = [st.gm for st in program.graphs.by_tp[0]]
    found: dict[tuple[str, str], dict[torch.dtype, None]] = {}
    for gm in graphs:
        for nd in gm.graph.nodes:
            val = nd.meta.get("val")
            if nd.op != "call_function" or getattr(nd.target, "namespace", None) != "autopar" \
                    or not isinstance(val, torch.Tensor):
                continue
            op = OPS.get(nd.target._opname)
            for direction, collective in (("forward", op and op.forward), ("backward", op and op.backward)):
                if collective:
                    found.setdefault((direction, collective), {})[val.dtype] = None
    plan.collectives = [dataclasses.replace(c, dtypes=tuple(found.get((c.direction, c.op), ())))
                        if c.axis == "tp" else c for c in plan.collectives]
    if plan.pipeline is not None:
        sends = {st.index: tuple(b.dtype for b in st.send) for st in program.pipeline_stages}
        stages = tuple(dataclasses.replace(sp, dtypes=sends[sp.index]) for sp in plan.pipeline.stages)
        plan.pipeline = dataclasses.replace(plan.pipeline, stages=stages)


def describe_reductions(program: Program, pol: Policy | None) -> Program:
    """Data-parallel gradient all-reduces travel in ``pol.reduce`` (their bytes scaled to it); returns ``program``."""
    if pol is None:
        return program
    program.plan.collectives = [
        dataclasses.replace(c, bytes=c.bytes * pol.reduce.itemsize // pol.stored.itemsize, dtypes=(pol.reduce,))
        if c.axis == "dp" and c.op == "all_reduce" and not c.dtypes else c for c in program.plan.collectives]
    return program
