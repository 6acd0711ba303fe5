"""Compile latency as the job grows: ``parallelize`` (capture and every pass, nothing run) at 8 to 4,096 ranks.

A LLaMA-3-8B-shaped model (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 128256, 32 layers)
is built on the meta device (no memory for weights) and compiled without a process group for dp x pp x tp
meshes of 8, 64, 512 and 4,096 ranks, each three ways: ZeRO-1, ZeRO-3 and with context parallelism (cp=2
taking a factor of dp); then 80 layers at 512 ranks. ``pp`` microbatches of ``2 pp``, sequence 4096.

Each row runs in a fresh process (no export or solution cached by an earlier row: what a job's first call
costs), after an untimed warm-up ``parallelize`` of a 2-layer model there that pays the imports and torch's
first-use costs. Printed per row: wall seconds and CPU seconds of the process (which other work on a shared
machine inflates less), the export alone (``torch.export``) and the passes (the rest), and the seconds to
bind the last rank's graph (``pm.graph(ranks - 1)``: rank graphs that differ only by coordinates are built
once per stage and bound per rank on first use).

``--check``: every row under 30 s of CPU, and growth at most logarithmic in the ranks: each row's CPU
seconds within ``t8 * (1 + 0.1 * log2(ranks / 8))`` of the 8-rank row of its kind (``t8``), i.e. at most
a tenth of the 8-rank time per doubling of the job (0.9x more at 4,096 ranks; linear growth would be 512x).
``--first-step``: the time to a job's first step on 4 local gloo ranks, as ``pm.plan`` reports it (export,
passes, the runtime's start, the first step itself), for a 32-layer LLaMA-3-shaped model narrowed to hidden
256 (real weights: the 8B shape does not fit this machine's memory four times over) on dp2 x pp2 and dp2 x tp2
with ZeRO-3.
Run: python benchmarks/compile_scaling.py [--check] [--layers 32] [--seq 4096] [--first-step]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
import time
from typing import Any

import torch

import autopar

RANKS = {8: (2, 2, 2), 64: (4, 4, 4), 512: (8, 8, 8), 4096: (64, 8, 8)}  # ranks -> dp, pp, tp
KINDS = ("zero1", "zero3", "cp2")
LIMIT_S = 30.0
PER_DOUBLING = 0.1


def llama(layers: int, hidden: int = 4096) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 7 // 2, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256 if hidden == 4096 else 512, num_hidden_layers=layers,
                      max_position_embeddings=8192, use_cache=False)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def mesh_of(ranks: int, kind: str) -> tuple[autopar.Mesh, int]:
    """The mesh of a row and its ZeRO stage."""
    dp, pp, tp = RANKS[ranks]
    if kind == "cp2":
        return autopar.Mesh(dp=dp // 2, cp=2, pp=pp, tp=tp), 1
    return autopar.Mesh(dp=dp, pp=pp, tp=tp), int(kind[-1])


def _compile(layers: int, hidden: int, mesh: autopar.Mesh, zero: int, seq: int) -> Any:
    m = 2 * mesh.pp
    ids = torch.zeros(mesh.dp * m, seq, dtype=torch.long, device="meta")
    return autopar.parallelize(llama(layers, hidden), mesh, example_inputs=(ids,), example_target=ids,
                               loss_fn=loss_fn, microbatches=m, zero=zero)


def row(ranks: int, kind: str, layers: int, seq: int) -> dict:
    """One row, in this process: the warm-up, then the timed ``parallelize`` and the last rank's graph."""
    mesh, zero = mesh_of(ranks, kind)
    _compile(2, 256, mesh, zero, 64)  # imports and first-use costs
    wall, cpu = time.perf_counter(), time.process_time()
    pm = _compile(layers, 4096, mesh, zero, seq)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    t = time.perf_counter()
    pm.graph(mesh.size - 1)
    bind = time.perf_counter() - t
    return {"ranks": ranks, "kind": kind, "layers": layers, "mesh": str(mesh), "wall": wall, "cpu": cpu,
            "export": pm.plan.timings.export, "bind": bind}


def _first_step(layers: int, mesh_axes: dict, zero: int) -> str:
    mesh = autopar.Mesh(**mesh_axes)
    model = llama(layers, 256).to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    ids = torch.randint(0, 512, (8, 128), generator=torch.Generator().manual_seed(0))
    pm = autopar.parallelize(model, mesh, loss_fn=loss_fn, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                             microbatches=2 * mesh.pp, zero=zero)
    pm.step(ids, target=ids)
    return pm.plan.timings.render()


def first_steps(layers: int) -> None:
    print(f"time to the first step, {layers}-layer LLaMA-3 shape at hidden 256, 4 local gloo ranks (rank 0's "
          "pm.plan)")
    for axes, zero in (({"dp": 2, "pp": 2}, 1), ({"dp": 2, "tp": 2}, 3)):
        text = autopar.launch(_first_step, 4, layers, axes, zero)[0]
        print(f"  {str(autopar.Mesh(**axes)):<24} zero {zero}: {text}", flush=True)


def run_row(ranks: int, kind: str, layers: int, seq: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--row", str(ranks), kind, str(layers), "--seq", str(seq)],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"row {ranks} {kind} {layers} layers failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bound(r: dict, base: dict) -> float:
    return base["cpu"] * (1 + PER_DOUBLING * math.log2(r["ranks"] / base["ranks"]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--first-step", action="store_true")
    p.add_argument("--row", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.first_step:
        first_steps(args.layers)
        return 0
    if args.row:
        print(json.dumps(row(int(args.row[0]), args.row[1], int(args.row[2]), args.seq)))
        return 0
    print(f"parallelize of a LLaMA-3-8B-shaped model on meta, no process group, sequence {args.seq}, "
          f"{2}x pp microbatches; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'ranks':>6} {'kind':>6} {'layers':>6}  {'mesh':<38} {'wall s':>7} {'cpu s':>6} {'export s':>8} "
          f"{'passes s':>8} {'bind ms':>8} {'bound s':>8}")
    rows, failures = [], []
    plan = [(r, k, args.layers) for k in KINDS for r in RANKS] + [(512, "zero1", 80)]
    base: dict[str, dict] = {}
    for ranks, kind, layers in plan:
        r = run_row(ranks, kind, layers, args.seq)
        rows.append(r)
        if layers == args.layers:
            base.setdefault(kind, r)
        limit = bound(r, base[kind]) if layers == args.layers else None
        print(f"{ranks:>6} {kind:>6} {layers:>6}  {r['mesh']:<38} {r['wall']:>7.2f} {r['cpu']:>6.2f} "
              f"{r['export']:>8.2f} {r['wall'] - r['export']:>8.2f} {1e3 * r['bind']:>8.1f} "
              + (f"{limit:>8.2f}" if limit is not None else f"{'-':>8}"), flush=True)
        if r["cpu"] > LIMIT_S:
            failures.append(f"{ranks} ranks {kind} {layers} layers: {r['cpu']:.1f} s > {LIMIT_S} s")
        if limit is not None and r["cpu"] > limit:
            failures.append(f"{ranks} ranks {kind}: {r['cpu']:.2f} s > {limit:.2f} s (logarithmic growth from "
                            f"{base[kind]['cpu']:.2f} s at {base[kind]['ranks']} ranks)")
    worst = max(r["cpu"] / base[r["kind"]]["cpu"] for r in rows if r["layers"] == args.layers)
    print(f"largest growth over the 8-rank row of its kind: {worst:.2f}x for up to {max(RANKS) // 8}x the ranks")
    if args.check:
        print("check: " + ("; ".join(failures) if failures else f"met (every row under {LIMIT_S:.0f} s, growth "
                                                                 f"within {PER_DOUBLING} x log2 of the ranks)"))
        return 1 if failures else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
