"""Mixed precision as a graph rewrite: placeholders take the dtype they are fed, a cast restores the captured one.

A graph captured with its parameters (and floating inputs) in a compute dtype
computes what the model computes in that dtype, its own dtype decisions
included (a norm that upcasts to float32 and back). The runtime feeds it other
dtypes: float32 master parameters, the user's float32 inputs.
``cast_placeholders`` makes each such placeholder's value the fed dtype and
inserts one ``aten._to_copy`` to the captured dtype before its first use (every
use reads the cast), marking both (``CAST`` on the cast, ``COMPUTE`` on the
placeholder) so that later passes can find them: the ZeRO-3 pass gathers in the
compute dtype and drops the cast. ``cast_outputs`` casts floating outputs (a
loss) to a wider dtype.

Invariant: fed tensors of the fed dtypes, the rewritten graph computes what the
captured graph computes on them cast to the captured dtypes. Autograd carries a
parameter's gradient back through its cast: the uses' gradients are summed in
the compute dtype, then converted once to the parameter's dtype, in which
microbatches accumulate and ranks reduce.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

CAST = "autopar.cast"  # on an inserted cast: the name of the placeholder it converts
COMPUTE = "autopar.compute_dtype"  # on a placeholder: the dtype its uses compute in


def retyped(val: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A fake tensor like ``val`` (shape, strides, device) of ``dtype``, in ``val``'s fake mode when it has one;
    with ``shape``, a contiguous one of that shape."""
    mode = val.fake_mode if isinstance(val, FakeTensor) else FakeTensorMode()
    with mode:
        if shape is not None:
            return torch.empty(shape, dtype=dtype, device=val.device)
        return torch.empty_strided(val.shape, val.stride(), dtype=dtype, device=val.device)


def cast_placeholders(gm: fx.GraphModule, fed: list[torch.dtype | None]) -> int:
    """Placeholder ``i`` (in order) takes dtype ``fed[i]`` (None: unchanged) and its uses a cast back; in place.

    Returns how many placeholders changed.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(fed):
        raise ValueError(f"the graph has {len(placeholders)} placeholders but {len(fed)} fed dtypes were given")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = 0
    for node, dtype in zip(placeholders, fed):
        val = node.meta.get("val")
        if dtype is None or not isinstance(val, torch.Tensor) or val.dtype == dtype or not val.is_floating_point():
            continue
        users = sorted(node.users, key=order.__getitem__)
        node.meta["val"] = retyped(val, dtype)
        node.meta.pop("tensor_meta", None)
        node.meta[COMPUTE] = val.dtype
        changed += 1
        if not users:
            continue
        with gm.graph.inserting_before(users[0]):
            cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": val.dtype})
        cast.meta.update({k: users[0].meta[k] for k in ("nn_module_stack", "stack_trace") if k in users[0].meta})
        cast.meta["val"] = val
        cast.meta[CAST] = node.name
        node.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)
    gm.graph.lint()
    gm.recompile()
    return changed


def cast_outputs(gm: fx.GraphModule, dtype: torch.dtype, *, skip: int = 0) -> int:
    """Floating tensor outputs narrower than ``dtype`` (after the first ``skip``) are cast to it; in place."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    changed = 0
    for i, value in enumerate(outs):
        val = value.meta.get("val") if isinstance(value, fx.Node) else None
        if i < skip or not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        if val.dtype.itemsize >= dtype.itemsize:
            continue
        with gm.graph.inserting_before(output):
            cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (value,), {"dtype": dtype})
        cast.meta["val"] = retyped(val, dtype)
        outs[i] = cast
        changed += 1
    output.args = (type(output.args[0])(outs),)
    gm.graph.lint()
    gm.recompile()
    return changed
