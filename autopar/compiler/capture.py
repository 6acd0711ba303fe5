"""Capture: an nn.Module (and its loss) -> one ATen-level torch.fx graph.

``capture`` runs ``torch.export`` (non-strict) on the model, or on the model
followed by the loss when a loss is asked for, and returns a ``Captured``:
a functional GraphModule whose placeholders are the parameters, buffers and
constants of the model followed by the flattened user inputs, plus the
signature that says which placeholder is which. Every node carries
``meta["val"]`` and ``meta["nn_module_stack"]``; passes rewrite the graph and
keep the signature.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.fx import config as fx_config
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from autopar.compiler.capture_cache import EXPORTS, Export, split_outputs
from autopar.compiler.export_key import export_key
from autopar.core.errors import CaptureError
from autopar.core.grad_regions import inline_grad_regions
from autopar.core.graph import PREFIX, Captured, Slot, SlotKind, tied_aliases
from autopar.compiler.experts import loop_over_all_experts
from autopar.compiler.export_files import exported
from autopar.compiler.log import log_pass
from autopar.passes.constant_masks import fold_constant_masks
from autopar.passes.expert_loops import densify_expert_loops
from autopar.passes.lazy_module import lazy_exports
from autopar.precision import in_compute_dtype, widened

LossFn = Callable[[Any, Any], torch.Tensor]


class _Forward(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, args: tuple, kwargs: dict) -> Any:
        return self.model(*args, **kwargs)


class _ForwardLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, loss_fn: LossFn | None, output_dtype: torch.dtype | None,
                 with_outputs: bool = False) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.output_dtype = output_dtype
        self.with_outputs = with_outputs  # return (loss, the model's outputs): both graphs in one export

    def forward(self, args: tuple, kwargs: dict, target: Any) -> Any:
        out = self.model(*args, **kwargs)
        wide = widened(out, self.output_dtype) if self.output_dtype is not None else out  # mixed: a float32 loss
        loss = self.loss_fn(wide, target) if self.loss_fn is not None else model_loss(wide)
        return (loss, out) if self.with_outputs else loss


def model_loss(out: Any) -> torch.Tensor:
    """The loss a model computes itself: a scalar output, or the ``loss`` entry of its output."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = out.get("loss") if hasattr(out, "get") else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    raise CaptureError(
        f"step() without loss_fn needs the model to return a scalar loss, got {type(out).__name__}",
        hint="pass loss_fn=lambda out, target: ... to parallelize, or pass the labels the model "
        "needs to compute its own loss (e.g. labels=...)",
    )


def capture(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    with_loss: bool = False,
    loss_fn: LossFn | None = None,
    target: Any = None,
    compute_dtype: torch.dtype | None = None,
) -> Captured:
    """Exports ``model(*args, **kwargs)`` (then ``loss_fn(out, target)`` when ``with_loss``).

    ``compute_dtype``: capture with the floating parameters and inputs in that dtype (fake tensors, nothing
    allocated), so the model's own dtype logic runs as it will in mixed precision (``autopar/precision.py``);
    the model's floating outputs are then cast to float32 before the loss.
    """
    kwargs = kwargs or {}
    check_inputs((args, kwargs, target))
    fed = [x.dtype if isinstance(x, torch.Tensor) else None
           for x in pytree.tree_leaves((args, kwargs, target) if with_loss else (args, kwargs))]
    with in_compute_dtype(model, compute_dtype, (args, kwargs), target) if compute_dtype is not None \
            else contextlib.nullcontext(((args, kwargs), target)) as ((args, kwargs), target):
        output_dtype = torch.float32 if compute_dtype is not None else None
        key = export_key(model, (args, kwargs, target if with_loss else None), loss_fn if with_loss else None,
                         with_loss=with_loss, output_dtype=output_dtype)
        export = EXPORTS.get(key)
        if export is None and with_loss and key is not None:  # the forward-only graph comes with it
            targets, inputs = pytree.tree_leaves(target), pytree.tree_leaves((args, kwargs))
            same = {t: next(i for i, x in enumerate(inputs) if x is y) for t, y in enumerate(targets)
                    if any(x is y for x in inputs)}  # (one tensor passed as input and target)
            joint = exported(("joint", key), lambda: Export.of(_export(
                model, args, kwargs, with_loss=True, loss_fn=loss_fn, target=target, output_dtype=output_dtype,
                with_outputs=True)))
            tensors = all(isinstance(x, torch.Tensor) for x in [*targets, *inputs])
            train, forward = split_outputs(joint, len(targets) if tensors else 0, same)
            EXPORTS.remember(export_key(model, (args, kwargs, None), None, with_loss=False,
                                        output_dtype=output_dtype) if forward is not None else None, forward)
            export = EXPORTS.put(key, train)
        elif export is None:
            export = EXPORTS.put(key, exported(key, lambda: Export.of(_export(
                model, args, kwargs, with_loss=with_loss, loss_fn=loss_fn, target=target, output_dtype=output_dtype))))
    captured = _dedupe_tied(_from_exported(export), model)
    captured.input_dtypes = fed
    with log_pass("expert loops -> dense dispatch", len(captured.gm.graph.nodes)) as info:
        info["detail"] = f"{densify_expert_loops(captured.gm)} expert selections made static"
        info["nodes"] = len(captured.gm.graph.nodes)
    with log_pass("constant attention masks -> is_causal", len(captured.gm.graph.nodes)) as info:
        info["detail"] = f"{fold_constant_masks(captured.gm)} attention calls rewritten"
        info["nodes"] = len(captured.gm.graph.nodes)
    return captured


def _export(model: torch.nn.Module, args: tuple, kwargs: dict, *, with_loss: bool, loss_fn: LossFn | None,
            target: Any, output_dtype: torch.dtype | None, with_outputs: bool = False) -> torch.export.ExportedProgram:
    wrapper: torch.nn.Module
    if with_loss:
        wrapper, export_args = _ForwardLoss(model, loss_fn, output_dtype, with_outputs), (args, kwargs, target)
    else:
        wrapper, export_args = _Forward(model), (args, kwargs)
    try:
        with loop_over_all_experts(model), _without_source_lines(), lazy_exports():
            return torch.export.export(wrapper, export_args, strict=False)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - every export failure becomes a CaptureError with a hint
        raise CaptureError(f"torch.export could not capture {type(model).__name__}", cause=e, hint=_hint(e)) from e


@contextlib.contextmanager
def _without_source_lines() -> Iterator[None]:
    """Exports without recording each node's Python stack (``meta["stack_trace"]``), a quarter of an export's
    time: errors name a node's module from ``meta["nn_module_stack"]`` instead (``core.graph.origin``)."""
    before = getattr(fx_config, "do_not_emit_stack_traces", None)
    if before is None:  # (a torch without the switch records them)
        yield
        return
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


def check_inputs(tree: Any) -> None:
    """Inputs must be tensors, Python scalars/strings/None, or containers of them."""
    for leaf in pytree.tree_leaves(tree):
        if not isinstance(leaf, (torch.Tensor, int, float, bool, str, type(None))):
            raise CaptureError(
                f"input of type {type(leaf).__name__} cannot be captured",
                hint="pass tensors, Python scalars, or lists/tuples/dicts of them",
            )


def _hint(e: BaseException) -> str:
    text = str(e)
    if "Cache" in text and "not a known type" in text:
        return "the model returns a key/value cache: build it with use_cache=False or pass use_cache=False"
    if "not a known type" in text or "pytree" in text:
        return "inputs and outputs must be tensors or (nested) tuples/lists/dicts of them; return tensors only"
    if "data-dependent" in text.lower() or "guard" in text.lower():
        return "the model branches on tensor values; rewrite that branch with torch.where or torch.cond"
    return "see the cause above; the model must run under torch.export(strict=False)"


def _from_exported(ep: Export) -> Captured:
    slots, constants = [], {}
    kinds = {InputKind.PARAMETER: SlotKind.PARAM, InputKind.BUFFER: SlotKind.BUFFER,
             InputKind.CONSTANT_TENSOR: SlotKind.CONSTANT}
    for spec in ep.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            slots.append(Slot(SlotKind.INPUT, spec.arg.name, index=sum(s.kind is SlotKind.INPUT for s in slots)))
        elif spec.kind in kinds:
            name = spec.target.removeprefix(PREFIX)
            slots.append(Slot(kinds[spec.kind], name))
            if spec.kind == InputKind.CONSTANT_TENSOR:
                constants[name] = ep.constants[spec.target]
        else:
            raise CaptureError(f"unsupported graph input kind {spec.kind.name} ({spec.target})")
    mutated = []
    for spec in ep.output_specs:
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutated.append(spec.target.removeprefix(PREFIX))
        elif spec.kind != OutputKind.USER_OUTPUT:
            raise CaptureError(f"the model mutates something autopar cannot track ({spec.kind.name} {spec.target})",
                               hint="do not assign to inputs inside forward")
    gm = ep.graph_module
    inline_grad_regions(gm)  # a torch.no_grad() block inside forward, as ops of the graph
    gm.meta["autopar.captured"] = True
    return Captured(gm=gm, slots=slots, mutated_buffers=mutated, out_spec=ep.out_spec, constants=constants)


def _dedupe_tied(c: Captured, model: torch.nn.Module) -> Captured:
    """One placeholder per tensor: uses of a tied alias are redirected to its canonical placeholder.

    Autograd then sums the gradient contributions of every use, as single-device
    training does for a tied parameter.
    """
    aliases = tied_aliases(model)
    nodes = [n for n in c.gm.graph.nodes if n.op == "placeholder"]
    by_name = {s.name: n for n, s in zip(nodes, c.slots) if s.kind is not SlotKind.INPUT}
    keep = []
    for node, slot in zip(nodes, c.slots):
        canonical = aliases.get(slot.name)
        if slot.kind is not SlotKind.INPUT and canonical is not None:
            if canonical not in by_name:  # the graph only names the alias: adopt it
                by_name[canonical] = node
                keep.append(Slot(slot.kind, canonical))
                continue
            node.replace_all_uses_with(by_name[canonical])
            c.gm.graph.erase_node(node)
            continue
        keep.append(slot)
    c.gm.recompile()
    c.slots = keep
    c.aliases = aliases
    return c
