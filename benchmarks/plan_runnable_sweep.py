"""Does the planner's ``runnable`` tell the truth? Plan small models for 2 and 4 CPU ranks, run a covering
sample of the candidates marked runnable for 2 steps on gloo ranks against one device, and report any that
raise or differ.

    python benchmarks/plan_runnable_sweep.py [--limit N] [--models gpt2,llama,bert,mixtral] [--devices 2,4]

The sample is chosen greedily so that every pair of option values (mesh, ZeRO stage, schedule, stages per
rank, microbatches, recompute, cp attention, sequence parallelism, precision) that the runnable candidates
have appears in at least one run, as far as ``--limit`` allows.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import models  # noqa: E402
from harness.mixed import assert_mixed  # noqa: E402

from autopar.planner import plan  # noqa: E402
from autopar.planner.cluster import Cluster  # noqa: E402
from autopar.runtime.launch import WorkerPool  # noqa: E402
from autopar.testing import assert_equivalent  # noqa: E402

BATCH, SEQ = 8, 16
MODELS = {  # name: (factory, planner precisions to plan with)
    "gpt2": (functools.partial(models.gpt2), ("fp64",)),
    "llama": (functools.partial(models.llama), ("fp64",)),
    "bert": (functools.partial(models.bert), ("fp64",)),
    "mixtral": (functools.partial(models.mixtral), ("fp32",)),
    "llama32": (functools.partial(models.llama, dtype=torch.float32), ("bf16", "mixed")),
}


def features(c, name: str, devices: int) -> dict[str, object]:
    k = c.config
    return {"model": name, "devices": devices, "mesh": (k.dp, k.pp, k.tp, k.cp, k.ep, k.dp_shard), "zero": k.zero,
            "schedule": (k.schedule, k.stages_per_rank), "m": k.microbatches, "recompute": str(c.recompute),
            "cp": (k.cp_attention, k.cp_a2a), "sp": k.sequence_parallel, "precision": c.precision}


def candidates(names: list[str], devices: list[int], memory: float | None) -> list[tuple[str, int, object]]:
    out = []
    for name, dev in itertools.product(names, devices):
        make, precisions = MODELS[name]
        for prec in precisions:
            cluster = Cluster.preset("cpu").replace(devices_per_node=2)
            if memory:
                cluster = cluster.replace(memory=memory)
            r = plan(make(), dev, cluster=cluster, global_batch=BATCH, seq_len=SEQ, precision=prec, optimizer="adam",
                     top=None, cp=(2,), max_microbatch=4)
            out += [(name, dev, c) for c in r.every.values()]
    return out


def covering(cands: list, limit: int) -> list:
    """Greedy: the candidate that adds the most unseen pairs of feature values, until none adds any."""
    seen: set = set()
    chosen = []
    pairs = [set(itertools.combinations(sorted((k, repr(v)) for k, v in features(c, n, d).items()), 2))
             for n, d, c in cands]
    while len(chosen) < limit:
        gain, i = max(((len(p - seen), i) for i, p in enumerate(pairs)), default=(0, -1))
        if gain == 0:
            break
        seen |= pairs[i]
        chosen.append(cands[i])
    return chosen


def run_one(launch, name: str, c) -> str:
    make = MODELS[name][0]
    ids = torch.randint(0, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    kw = c.parallelize_options()
    if name == "mixtral":  # float32 (no float64 grouped-expert kernel): float32's bound, as tests/test_expert_grouped
        kw.update(rtol=1e-3, atol=1e-4, update_rtol=1e-3)
    if kw["precision"] != "fp32":  # bf16's bounds are measured under SGD, and checked per parameter there
        assert_mixed(make, c.mesh, (ids,), ids, models.lm_loss, models.sgd, 2, launch, **kw)
        return "ok"
    optimizer = models.sgd if name == "mixtral" else models.adamw
    assert_equivalent(make, c.mesh, (ids,), ids, models.lm_loss, optimizer, steps=2, launcher=launch, **kw)
    return "ok"


def memory_check(pool: WorkerPool, name: str, devices: int, cands: list) -> int:
    """One candidate of each (hybrid, cp attention, ep, schedule, ZeRO stage) of ``name``: every rank's predicted
    parameter, gradient and optimizer bytes against ``pm.memory()`` after one step, within 10%; the mismatches."""
    from test_planner import _run_meshes

    pick: dict = {}
    for c in cands:
        k = c.config
        pick.setdefault((k.dp_shard, k.cp_attention if k.cp > 1 else "", k.ep, k.schedule if k.pp > 1 else "",
                         k.zero, k.tp > 1), c)
    chosen = list(pick.values())
    runs = pool.launch(_run_meshes, devices, MODELS[name][0], (BATCH, SEQ, 96), [c.parallelism for c in chosen], 0)
    bad = 0
    for i, c in enumerate(chosen):
        off = [(rank, key, runs[rank][i][1][key], round(float(want)))
               for rank in range(devices) for key, want in c.estimate.per_rank[c.mesh.coords(rank).pp].items()
               if key in ("parameters", "gradients", "optimizer")
               and abs(runs[rank][i][1][key] - float(want)) > 0.10 * max(float(want), 1.0)]
        bad += bool(off)
        print(f"memory {name} {devices} {c.config.describe()}: {'ok' if not off else f'MISMATCH {off[:4]}'}",
              flush=True)
    return bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--models", default="gpt2,llama,bert,mixtral")
    ap.add_argument("--devices", default="2,4")
    ap.add_argument("--memory", type=float, default=None, help="device memory (bytes) to plan for")
    ap.add_argument("--layers", type=int, default=2, help="transformer layers of every model")
    ap.add_argument("--sequence-parallel", action="store_true", help="only candidates with sequence parallelism")
    ap.add_argument("--memory-check", action="store_true",
                    help="compare predicted state bytes with pm.memory() instead of training against one device")
    ap.add_argument("--runnable", type=int, default=1, help="1: sample the runnable ones; 0: the others")
    args = ap.parse_args()
    for name, (make, precisions) in MODELS.items():
        MODELS[name] = (functools.partial(make, layers=args.layers), precisions)
    cands = [x for x in candidates(args.models.split(","), [int(d) for d in args.devices.split(",")], args.memory)
             if x[2].runnable == bool(args.runnable) and (x[2].config.sequence_parallel or not args.sequence_parallel)]
    if args.memory_check:
        with WorkerPool(4) as pool:
            bad = sum(memory_check(pool, name, dev, [c for n, d, c in cands if (n, d) == (name, dev)])
                      for name, dev in dict.fromkeys((n, d) for n, d, _ in cands))
        print(f"{bad} memory mismatches")
        return
    chosen = covering(cands, args.limit)
    print(f"{len(cands)} candidates, {len(chosen)} chosen", flush=True)
    failures = 0
    with WorkerPool(4) as pool:
        for name, dev, c in chosen:
            start = time.perf_counter()
            try:
                result = run_one(pool.launch, name, c)
            except Exception as e:  # noqa: BLE001 - every failure is reported
                failures += 1
                result = f"FAIL {type(e).__name__}: {str(e)[:400]}"
                traceback.print_exc(limit=3)
            print(f"{name} {dev} {c.config.describe()} rc={c.recompute} prec={c.precision} "
                  f"[{time.perf_counter() - start:.1f}s] {result}", flush=True)
    print(f"{failures} of {len(chosen)} failed")


if __name__ == "__main__":
    main()
