"""How long the planner takes on large models built on the meta device (no memory).

The two timed plans: GPT-3 175B for 1,024 DGX-A100 devices (global batch
1,536) and the trillion-parameter GPT of Narayanan et al. 2021 (128 layers,
hidden 25,600, 160 heads) for 3,072 (global batch 3,072), sequence 2,048,
mixed precision. ``--families`` adds the model families of
``tests/harness/families.py`` (LLaMA-2 7B and 70B, Mistral-7B, Qwen2-7B,
Gemma-7B, Mixtral-8x7B, T5-3B and 11B, BERT-large, ViT-huge; they need
transformers) for 64 devices. For each plan it prints the seconds of building
the meta model, of the profile (the graph captures) and of the search, wall
and CPU, the configurations planned and timed, and the best.

``--check`` exits 1 when a plan (profile and search, wall seconds) of GPT-3
175B takes 20 s or more, or of the trillion-parameter GPT 60 s or more (the
families: ``--limit``): a wall-clock check, so not in the test suite, where a
loaded machine would fail it. The CPU seconds say how much of the wall time
was this process's own work.
Run: python benchmarks/planner_speed.py [--check] [--models gpt3-175b gpt-1t] [--families]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from autopar.planner import gpt3_175b, gpt_1t, plan
from autopar.planner.model_profile import profile_model

LIMITS = {"gpt3-175b": 20.0, "gpt-1t": 60.0}  # seconds of a plan (profile and search), --check


def jobs(families: bool) -> dict[str, tuple[Callable[[], torch.nn.Module], int, int, int | None]]:
    """name -> (factory, devices, global batch, sequence length)."""
    out = {"gpt3-175b": (gpt3_175b, 1024, 1536, 2048), "gpt-1t": (gpt_1t, 3072, 3072, 2048)}
    if families:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from harness.families import FAMILIES

        for name, factory, _, seq, _ in FAMILIES:
            out[name] = (factory, 64, 64 if seq else 1024, seq)
    return out


def timed(factory: Callable[[], torch.nn.Module], devices: int, batch: int, seq: int | None) -> dict[str, float | str]:
    """Wall and CPU seconds of building the model, its profile and the search, and what the plan found."""
    marks = [(time.perf_counter(), time.process_time())]
    with torch.device("meta"):
        model = factory()
    marks.append((time.perf_counter(), time.process_time()))
    sizes = tuple(t for t in (1, 2, 4, 8) if devices % t == 0)
    profile = profile_model(model, sequence=seq is not None, tp_sizes=sizes)
    marks.append((time.perf_counter(), time.process_time()))
    result = plan(model, devices, cluster="dgx-a100", global_batch=batch, seq_len=seq, profile=profile)
    marks.append((time.perf_counter(), time.process_time()))
    (w0, c0), (w1, c1), (w2, c2), (w3, c3) = marks
    return {"build": w1 - w0, "profile": w2 - w1, "search": w3 - w2, "plan": w3 - w1, "plan_cpu": c3 - c1,
            "profile_cpu": c2 - c1, "search_cpu": c3 - c2,
            "what": f"{result.considered} configurations, {result.timed} timed; best {result.best.config.describe()}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", help="names to run (default: the two GPTs, and the families with --families)")
    p.add_argument("--families", action="store_true", help="also the model families (needs transformers)")
    p.add_argument("--check", action="store_true", help="exit 1 when a plan takes its limit or longer")
    p.add_argument("--limit", type=float, default=30.0, help="seconds a family's plan may take under --check")
    a = p.parse_args()
    table = jobs(a.families or any(m not in LIMITS for m in a.models or ()))
    slow = []
    for name in a.models or list(table):
        t = timed(*table[name])
        limit = LIMITS.get(name, a.limit)
        print(f"{name:<14} build {t['build']:5.1f} s  plan {t['plan']:5.1f} s (limit {limit:.0f} s; profile "
              f"{t['profile']:.1f} s, search {t['search']:.1f} s; CPU {t['plan_cpu']:.1f} s: {t['profile_cpu']:.1f} "
              f"+ {t['search_cpu']:.1f})  {t['what']}", flush=True)
        if t["plan"] >= limit:
            slow.append(f"{name} {t['plan']:.1f} s >= {limit:.0f} s")
    if a.check:
        print("check: " + (f"FAILED: {'; '.join(slow)}" if slow else "passed"))
        sys.exit(1 if slow else 0)


if __name__ == "__main__":
    main()
