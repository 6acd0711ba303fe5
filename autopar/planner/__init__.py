"""The planner: choose data, tensor and pipeline parallelism, ZeRO, schedule and microbatches, and say why.

``plan(model, devices=N, cluster=..., global_batch=..., seq_len=...)`` profiles
the model once from its graph (``autopar.planner.cost_model``; a meta-device model
needs no memory), then evaluates every configuration of the search space:

- meshes ``dp x pp x tp = N`` (tp among the sizes the profile analyzed);
- ZeRO stage 0-3 over dp;
- schedule (GPipe, 1F1B, interleaved 1F1B with 2 or 4 stages per rank, the zero-bubble schedules);
- microbatch size ``b`` (every divisor of the dp rank's batch up to
  ``max_microbatch``) and with it the microbatch count;
- activation recomputation on or off.

Candidates that fit the device memory are ranked by estimated step time (the
time only of those a lower bound does not rule out of the best ``top``, of the
best of each tp and pp size, or of the best autopar runs: ``bound.py``);
each carries its memory per device, step-time breakdown, throughput, and
whether autopar's runtime runs it today (``runnable``). The result explains
the choice in checkable sentences: what the largest layer needs, why a
smaller tp or pp does not fit or is slower, what the bubble and the exposed
communication cost.

The planner's files: ``autopar/planner/search.py`` (the search space, evaluation
and ranking: ``plan``, ``Candidate``, ``PlanResult``),
``autopar/planner/report.py`` (the table and the explanation),
``autopar/planner/auto.py`` (``parallelize(model, "auto")``). This module is
their entry point, with model factories for planning (``autopar/planner/gpt.py``: ``gpt(layers, hidden,
heads)``, ``gpt3_175b``, ``gpt_1t``; ``autopar/planner/llama.py``: ``llama(layers, hidden, heads, kv_heads,
ffn)``, ``llama3_8b``, ``llama3_70b``, ``llama3_405b``; plain torch, no Hugging Face needed).
"""
from __future__ import annotations

from autopar.planner.auto import auto_choice, sequence_of
from autopar.planner.gpt import GPT, gpt, gpt3_175b, gpt_1t
from autopar.planner.llama import Llama, llama, llama3_8b, llama3_70b, llama3_405b
from autopar.planner.report import explain
from autopar.planner.result import Candidate, PlanResult
from autopar.planner.search import plan, search_space

__all__ = ["Candidate", "PlanResult", "plan", "search_space", "explain", "auto_choice", "sequence_of", "GPT", "gpt",
           "gpt3_175b", "gpt_1t", "Llama", "llama", "llama3_8b", "llama3_70b", "llama3_405b"]
