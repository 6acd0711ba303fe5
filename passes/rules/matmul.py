"""Sharding rules for the matmul family (mm, bmm, addmm, baddbmm, linear, matmul,
einsum), each written as an einsum string and derived by ``einsum_strategies``.

Every strategy is sound on real tensors, as ``tests/test_sharding_rules.py``
checks for each entry.
"""

from __future__ import annotations

import string

import torch

from autopar.passes.rules.base import Call, Op, Rule, Strategy, einsum_strategies, explicit_equation

aten = torch.ops.aten


def _letters(k: int) -> str:
    """``k`` letters for batch dims, distinct from the lowercase ones the equations use."""
    return string.ascii_uppercase[:k]


def _mm(call: Call) -> list[Strategy]:
    return einsum_strategies(call, "mk,kn->mn", ["self", "mat2"])


def _bmm(call: Call) -> list[Strategy]:
    return einsum_strategies(call, "bmk,bkn->bmn", ["self", "mat2"])


def _addmm(call: Call) -> list[Strategy]:
    return einsum_strategies(call, "mk,kn->mn", ["mat1", "mat2"], bias="self")


def _baddbmm(call: Call) -> list[Strategy]:
    return einsum_strategies(call, "bmk,bkn->bmn", ["batch1", "batch2"], bias="self")


def _linear(call: Call) -> list[Strategy] | None:
    x, w = call["input"], call["weight"]
    if x.ndim == 0 or w.ndim not in (1, 2):
        return None
    batch = _letters(x.ndim - 1)
    equation = f"{batch}k,nk->{batch}n" if w.ndim == 2 else f"{batch}k,k->{batch}"
    return einsum_strategies(call, equation, ["input", "weight"], None if call["bias"] is None else "bias")


def _matmul(call: Call) -> list[Strategy] | None:
    a, b = call["self"], call["other"]
    if a.ndim == 0 or b.ndim == 0:
        return None
    batch_a, batch_b = max(a.ndim - 2, 0), max(b.ndim - 2, 0)
    batch = _letters(max(batch_a, batch_b))
    la = batch[len(batch) - batch_a :] + ("mk" if a.ndim >= 2 else "k")
    lb = batch[len(batch) - batch_b :] + ("kn" if b.ndim >= 2 else "k")
    out = batch + ("m" if a.ndim >= 2 else "") + ("n" if b.ndim >= 2 else "")
    return einsum_strategies(call, f"{la},{lb}->{out}", ["self", "other"])


def _einsum(call: Call) -> list[Strategy] | None:
    tensors = call["tensors"]
    equation = explicit_equation(call["equation"], [t.ndim for t in tensors])
    if equation is None:
        return None
    return einsum_strategies(call, equation, [("tensors", i) for i in range(len(tensors))])


RULES: dict[Op, Rule] = {
    aten.mm.default: _mm,  # "mk,kn->mn"
    aten.bmm.default: _bmm,  # "bmk,bkn->bmn"
    aten.addmm.default: _addmm,  # bias + "mk,kn->mn" (GPT-2 Conv1D: weight is (in, out))
    aten.baddbmm.default: _baddbmm,  # bias + "bmk,bkn->bmn"
    aten.linear.default: _linear,  # "...k,nk->...n" + bias "n" (weight is (out, in))
    aten.matmul.default: _matmul,  # "...mk,...kn->...mn", batch dims broadcast, 1-D operands squeezed
    aten.einsum.default: _einsum,  # the equation itself, ellipses spelled out
}
