"""Expert parallelism against replicated experts: step time, all-to-all bytes and expert memory, on 2 ranks.

The model is Hugging Face's Mixtral with its experts as a loop (``_experts_implementation = "eager"``), sized
so that the experts dominate (hidden 256, 8 experts of width 1,024, top-2, 2 layers). Two contenders on the
same 2 gloo ranks, built from one seed, their steps interleaved (each first on every other step, a barrier
before each), median step time over every timed step of both ranks:

- ``ep=1``: ``Mesh(dp=2)``, today's replicated experts: autopar captures the loop as dense dispatch, every
  expert on every token (E/k = 4 times the routed FLOPs);
- ``ep=2``: ``Mesh(dp=2, ep=2)``: each rank holds 4 experts and runs them on the rows routed to them, the
  tokens sent and returned by all-to-all (goal: ep=2 / ep=1 <= 0.7).

It also checks the planner's numbers for the ep=2 configuration (``autopar.plan``, precision fp32): the
all-to-all bytes the two ranks send per step (``pm.communication()``) against the formula (4 T k H elements
per rank, layer and microbatch, plus E int64 row counts), and each rank's parameter, gradient and optimizer
bytes (``pm.memory()``) against the plan (within 5%) and against ep=1 (the experts' part divided by 2).

Run: PYTHONPATH=. python benchmarks/expert_parallel.py [--steps 10] [--rounds 2] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

import autopar
from dp_vs_ddp import time_interleaved  # benchmarks/: each contender first on every other step

BATCH, SEQ, VOCAB = 8, 64, 512


def build() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                        pad_token_id=0, bos_token_id=0, eos_token_id=0, num_local_experts=8, num_experts_per_tok=2)
    model = MixtralForCausalLM(cfg).train()
    model.config._experts_implementation = "eager"
    return model


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return ids, ids


def _rank(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    x, y = batch()
    optimizer = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    pms = {name: autopar.parallelize(build(), mesh, loss_fn=loss_fn, optimizer=optimizer)
           for name, mesh in (("ep=1", autopar.Mesh(dp=2)), ("ep=2", autopar.Mesh(dp=2, ep=2)))}
    steps = {name: (lambda pm=pm: pm.step(x, target=y)) for name, pm in pms.items()}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for k, v in time_interleaved(steps, args.steps, args.warmup).items():
            times[k] += v
    taken = args.rounds * (args.steps + args.warmup)
    return {"times": times, "steps": taken, "memory": {k: pm.memory() for k, pm in pms.items()},
            "communication": pms["ep=2"].communication()}


def _planned() -> Any:
    """The planner's ep=2 candidate (and the ep=1 one) for this model on 2 CPU ranks."""
    from autopar.planner.config import Config

    result = autopar.plan(build(), 2, cluster="cpu", global_batch=BATCH, seq_len=SEQ, precision="fp32",
                          optimizer="adam", tp=(1,), pp=(1,), zero=(0,), recompute=("none",), top=None)
    ep2, ep1 = (result.candidate(Config(dp=2, ep=e, microbatch_size=BATCH // 2)) for e in (2, 1))
    return result, ep2, ep1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args()
    per_rank = autopar.launch(_rank, 2, args)
    median = {k: statistics.median([t for r in per_rank for t in r["times"][k]]) for k in ("ep=1", "ep=2")}
    print(f"2 gloo ranks, {args.threads} thread(s) each, {args.rounds} rounds x {args.steps} interleaved steps "
          f"(+{args.warmup} warm-up each round); Mixtral eager, hidden 256, 8 experts x 1024, top-2, 2 layers, "
          f"batch {BATCH}x{SEQ}, AdamW, fp32")
    print("| contender | median step (ms) |\n|---|---:|")
    for k, v in median.items():
        print(f"| {k} | {v * 1e3:.1f} |")
    print(f"ratio ep=2 / ep=1: {median['ep=2'] / median['ep=1']:.2f} (goal <= 0.7)")

    result, ep2, ep1 = _planned()
    calls, planned = result.cost.expert_all_to_all(ep2.config)
    steps = per_rank[0]["steps"]
    sent = sum(r["communication"].get("all_to_all_v@ep", 0) + r["communication"].get("all_to_all@ep", 0)
               for r in per_rank) / steps
    print(f"all-to-all bytes per step, both ranks: measured {sent:,.0f}, formula 2 x {planned:,.0f} = "
          f"{2 * planned:,.0f} ({'equal' if sent == 2 * planned else 'DIFFERENT'}; {calls} calls per rank)")
    print("| rank | key | pm.memory() ep=2 | plan ep=2 | measured / plan | ep=1 measured | ep=2 / ep=1 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for rank, r in enumerate(per_rank):
        for key in ("parameters", "gradients", "optimizer"):
            got, want, one = r["memory"]["ep=2"][key], float(ep2.memory[key]), r["memory"]["ep=1"][key]
            print(f"| {rank} | {key} | {got:,} | {want:,.0f} | {got / want:.3f} | {one:,} | {got / one:.3f} |")
    share = sum(x.params for x in result.profile.experts.layers) / result.profile.total_params
    print(f"experts hold {share:.1%} of the parameters: dividing them by ep=2 leaves {1 - share / 2:.3f} of ep=1's")


if __name__ == "__main__":
    main()
