"""Context parallelism on a long sequence: the ring's exposed communication and the activations per rank.

The model is Hugging Face's LLaMA built from a small config (hidden 128, 4 heads, 2 layers, vocabulary 512) with
random weights, one sequence of ``--seq`` tokens (4,096 by default), fp32, AdamW. It runs on one rank
(``Mesh(dp=1)``) and on two (``Mesh(cp=2)``: each rank holds chunks 0 and 3, or 1 and 2, of 4):

- **exposed ring**: per cp step, the seconds the rank's host waited in ring attention for a K/V block or its
  gradients (``pm.timeline(layers=True)``'s ``ring_wait`` records, all inside the step's actions) against the
  step (the actions' span); the median over the timed steps, the larger rank's (goal: <= 20%);
- **activations per rank**: the distinct storages the forward saves for backward (``saved_tensors_hooks``
  around the step, parameters not counted) at cp=1 and on each cp=2 rank, against the planner's kept
  activations for the same configuration (``autopar.plan(..., cp=...)``, ``memory["activations"]``; goal:
  within 10%) and against each other (goal: cp=1 / cp=2 close to 2);
- **a budget one rank cannot meet**: ``--budget-gb`` (default: halfway between the two measured peaks) caps the
  address space each rank may add during a step (``RLIMIT_AS`` set after a warm-up step, glibc's mmap threshold
  fixed so freed blocks go back); the step at cp=1 runs out of memory, each cp=2 rank's step completes.

Run: PYTHONPATH=. python benchmarks/context_parallel.py [--seq 4096] [--steps 4] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
from typing import Any

import torch

import autopar

VOCAB = 512
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # ranks start with it: large blocks are unmapped


def build(seq: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=seq, use_cache=False,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).train()


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    return ids, ids.roll(-1, 1)


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while active, ``skip``'s storages apart."""

    def __init__(self, skip: list[torch.Tensor]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in skip}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in self.skip:
            self.seen[s.data_ptr()] = s.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _address_space() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def _rank(args: argparse.Namespace, cp: int, budget: float | None) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    x, y = batch(args.seq)
    mesh = autopar.Mesh(cp=2) if cp == 2 else autopar.Mesh(dp=1)
    pm = autopar.parallelize(build(args.seq), mesh, loss_fn=loss_fn,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    pm.step(x, target=y)  # compiles
    saved = SavedBytes(pm.parameters())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        pm.step(x, target=y)
    shares, steps = [], []
    for _ in range(args.steps):
        pm.step(x, target=y)
        records = pm.timeline(layers=True)
        actions = [r for r in records if r[0] != "ring_wait"]
        span = actions[-1][2] - actions[0][1]
        shares.append(sum(e - s for name, s, e in records if name == "ring_wait") / span)
        steps.append(span)
    out = {"saved": saved.total, "exposed": statistics.median(shares), "step": statistics.median(steps)}
    if budget is not None:
        limit = int(_address_space() + budget)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        try:
            pm.step(x, target=y)
            out["budget"] = "ran"
        except (RuntimeError, MemoryError) as e:
            out["budget"] = f"out of memory ({str(e).splitlines()[0][:80]})"
    return out


def _planned(seq: int) -> dict[int, float]:
    """The planner's kept activations per rank at cp=1 (one rank) and cp=2 (two ranks)."""
    from autopar.planner.config import Config

    out = {}
    for cp in (1, 2):
        result = autopar.plan(build(seq), cp, cluster="cpu", global_batch=1, seq_len=seq, precision="fp32",
                              optimizer="adam", tp=(1,), pp=(1,), zero=(0,), recompute=("none",), cp=(cp,),
                              top=None)
        out[cp] = float(result.candidate(Config(dp=1, cp=cp, microbatch_size=1)).memory["activations"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4, help="timed steps")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--budget-gb", type=float, default=None, help="bytes a rank may add during a step")
    args = p.parse_args()
    one = autopar.launch(_rank, 1, args, 1, None)[0]
    two = autopar.launch(_rank, 2, args, 2, None)
    planned = _planned(args.seq)
    print(f"LLaMA hidden 128, 4 heads, 2 layers, vocab {VOCAB}; one sequence of {args.seq} tokens, fp32, AdamW; "
          f"{args.threads} thread(s) per rank")
    print("| run | step (ms) | ring waits / step | saved activations | planner | measured / planner |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = [("cp=1", one, planned[1])] + [(f"cp=2 rank {r}", o, planned[2]) for r, o in enumerate(two)]
    for name, o, want in rows:
        print(f"| {name} | {o['step'] * 1e3:.0f} | {o['exposed']:.1%} | {o['saved'] / 2**20:.1f} MiB | "
              f"{want / 2**20:.1f} MiB | {o['saved'] / want:.3f} |")
    print(f"exposed ring: {max(o['exposed'] for o in two):.1%} of the step (goal <= 20%); activations cp=1 / cp=2 "
          f"rank: {one['saved'] / max(o['saved'] for o in two):.2f}")
    budget = args.budget_gb * 2**30 if args.budget_gb else (one["saved"] + max(o["saved"] for o in two)) / 2
    one = autopar.launch(_rank, 1, args, 1, budget)[0]
    two = autopar.launch(_rank, 2, args, 2, budget)
    print(f"budget {budget / 2**20:.0f} MiB added per rank during a step: cp=1 {one['budget']}; "
          + "; ".join(f"cp=2 rank {r} {o['budget']}" for r, o in enumerate(two)))


if __name__ == "__main__":
    main()
