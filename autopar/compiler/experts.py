"""Routed experts whose forward iterates over the experts that received tokens, exported as a loop over all.

Hugging Face's eager experts (``config._experts_implementation == "eager"``) loop over
``expert_hit = (...).nonzero()`` and skip a sentinel expert with ``if expert_idx == num_experts``: both
branch on tensor values, so ``torch.export`` cannot capture them. Such a module is recognised by what it
holds and how it is called, not by its class: stacked expert weights (``gate_up_proj`` or ``up_proj``, and
``down_proj``, each (E, ...)), the flags Hugging Face's experts interface sets (``has_gate``,
``is_transposed``, ``has_bias``), and a call ``(hidden_states, top_k_index, top_k_weights)``.

While exporting, ``loop_over_all_experts`` gives each such module a forward that computes the same thing
with a loop over every expert and ``torch.where(top_k_index == e)``; ``passes/expert_loops.py`` then makes
that loop static (dense dispatch). The forward depends only on the module, so an export of the same model is
the same graph (the export cache's key, ``autopar/compiler/export_key.py``, stays exact).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

EAGER = "eager"


def loops_over_hit_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a stacked-experts module whose own forward loops over the experts hit."""
    config = getattr(module, "config", None)
    up = getattr(module, "gate_up_proj", None) if getattr(module, "has_gate", False) else getattr(module, "up_proj", None)
    down = getattr(module, "down_proj", None)
    return (getattr(config, "_experts_implementation", None) == EAGER and isinstance(up, torch.Tensor)
            and isinstance(down, torch.Tensor) and up.dim() == 3 and down.dim() == 3
            and hasattr(module, "is_transposed") and hasattr(module, "has_bias"))


def _expert(module: torch.nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of a stacked-experts module on rows ``x`` (R, H) -> (R, H)."""
    def linear(name: str, h: torch.Tensor) -> torch.Tensor:
        weight = getattr(module, name)[e]
        bias = getattr(module, name + "_bias")[e] if module.has_bias else None
        return F.linear(h, weight.T if module.is_transposed else weight, bias)

    if module.has_gate:
        h = module._apply_gate(linear("gate_up_proj", x))
    else:
        h = module.act_fn(linear("up_proj", x))
    out = linear("down_proj", h)
    return module.post_expert_norm(out) if getattr(module, "has_post_expert_norm", False) else out


def _all_experts_forward(module: torch.nn.Module):
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)  # (T, H)
        for e in range(module.down_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)  # the rows that picked expert e
            rows = _expert(module, e, hidden_states[token]) * top_k_weights[token, slot, None]
            out = out.index_add(0, token, rows.to(out.dtype))
        return out
    return forward


@contextlib.contextmanager
def loop_over_all_experts(model: torch.nn.Module) -> Iterator[int]:
    """Within the block, every module that loops over the experts hit loops over all of them; yields how many."""
    found = [m for m in model.modules() if loops_over_hit_experts(m)]
    for m in found:
        m.forward = _all_experts_forward(m)
    try:
        yield len(found)
    finally:
        for m in found:
            del m.forward
