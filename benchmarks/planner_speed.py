"""How long the planner takes on large models built on the meta device (no memory).

Plans GPT-3 175B for 1,024 DGX-A100 devices and the model families of
``tests/harness/families.py`` (LLaMA-2 7B and 70B, Mistral-7B, Qwen2-7B,
Gemma-7B, Mixtral-8x7B, T5-3B and 11B, BERT-large, ViT-huge) for 64, and
prints the seconds each takes (building the meta model, then ``plan``: the
captures and the search). ``--check`` exits 1 when a plan takes longer than
``--limit`` seconds (default 30): a wall-clock check, so not in the test
suite, where a loaded machine would fail it.
Run: python benchmarks/planner_speed.py [--models gpt3-175b llama2-70b ...] [--check [--limit 30]]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from autopar.planner import gpt3_175b, plan  # noqa: E402
from harness.families import FAMILIES  # noqa: E402


def jobs() -> dict[str, tuple[Callable[[], torch.nn.Module], int, int, int | None]]:
    """name -> (factory, devices, global batch, sequence length)."""
    out = {"gpt3-175b": (gpt3_175b, 1024, 1536, 2048)}
    for name, factory, _, seq, _ in FAMILIES:
        out[name] = (factory, 64, 64 if seq else 1024, seq)
    return out


def timed(factory: Callable[[], torch.nn.Module], devices: int, batch: int, seq: int | None) -> tuple[float, float, str]:
    start = time.perf_counter()
    with torch.device("meta"):
        model = factory()
    built = time.perf_counter()
    result = plan(model, devices, cluster="dgx-a100", global_batch=batch, seq_len=seq)
    return built - start, time.perf_counter() - built, f"{result.considered} configurations, best " \
        f"{result.best.config.describe()}"


def main() -> None:
    table = jobs()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(table), choices=list(table))
    p.add_argument("--check", action="store_true", help="exit 1 when a plan takes longer than --limit seconds")
    p.add_argument("--limit", type=float, default=30.0)
    a = p.parse_args()
    slow = []
    for name in a.models:
        build, seconds, what = timed(*table[name])
        print(f"{name:<14} build {build:5.1f} s  plan {seconds:5.1f} s  {what}", flush=True)
        if seconds > a.limit:
            slow.append(name)
    if a.check:
        print("check: " + (f"FAILED, over {a.limit:.0f} s: {', '.join(slow)}" if slow else "passed"))
        sys.exit(1 if slow else 0)


if __name__ == "__main__":
    main()
