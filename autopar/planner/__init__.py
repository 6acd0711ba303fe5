"""The planner: choose data, tensor and pipeline parallelism, ZeRO, schedule and microbatches, and say why.

``plan(model, devices=N, cluster=..., global_batch=..., seq_len=...)`` profiles
the model once from its graph (``autopar.planner.cost_model``; a meta-device model
needs no memory), then evaluates every configuration of the search space:

- meshes ``dp x pp x tp = N`` (tp among the sizes the profile analyzed);
- ZeRO stage 0-3 over dp;
- schedule (GPipe, 1F1B, interleaved 1F1B with 2 or 4 stages per rank);
- microbatch size ``b`` (every divisor of the dp rank's batch up to
  ``max_microbatch``) and with it the microbatch count;
- activation recomputation on or off.

Candidates that fit the device memory are ranked by estimated step time;
each carries its memory per device, step-time breakdown, throughput, and
whether autopar's runtime runs it today (``runnable``). The result explains
the choice in checkable sentences: what the largest layer needs, why a
smaller tp or pp does not fit or is slower, what the bubble and the exposed
communication cost.

The planner's files: ``autopar/planner/search.py`` (the search space, evaluation
and ranking: ``plan``, ``Candidate``, ``PlanResult``),
``autopar/planner/report.py`` (the table and the explanation),
``autopar/planner/auto.py`` (``parallelize(model, "auto")``). This module is
their entry point, with model factories for planning (``gpt``, ``gpt3_175b``).
"""
from __future__ import annotations

import torch

from autopar.planner.auto import auto_choice, sequence_of
from autopar.planner.report import explain
from autopar.planner.search import Candidate, PlanResult, plan, search_space


def gpt(layers: int, hidden: int, heads: int, *, vocab: int = 51200, positions: int = 2048) -> torch.nn.Module:
    """A GPT (Hugging Face GPT-2 architecture) of the given size on the meta device: no memory, for planning."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=positions,
                        use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def gpt3_175b() -> torch.nn.Module:
    """GPT-3 175B (Brown et al. 2020): 96 layers, hidden 12288, 96 heads, 2048 positions, on the meta device."""
    return gpt(96, 12288, 96, vocab=50257)


__all__ = ["Candidate", "PlanResult", "plan", "search_space", "explain", "auto_choice", "sequence_of", "gpt",
           "gpt3_175b"]
