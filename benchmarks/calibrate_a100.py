"""Fits the DGX-A100 preset's two compute constants to Megatron-LM's published GPT runs.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC21, arXiv:2104.04473), Table 1: ten GPT runs on
DGX-A100 80GB nodes with their tp, pp, GPU count, global batch and achieved
teraFLOP/s per GPU (counted with the paper's equation (3)). For every
(efficiency, narrow) on a grid, each run is planned as the paper ran it
(tp and pp fixed, zero=0, recomputation, gradient all-reduce after backward)
and the fit minimizes the squared log ratio of planned to published
teraFLOP/s. By default it fits the seven rows not in ``HELD_OUT_ROWS``
(``autopar/planner/megatron.py``) and then plans the three held-out rows with the
fitted pair, so their errors are a check on runs the constants never saw.
Prints the best pair and each run's error under it.
Run: python benchmarks/calibrate_a100.py [--rows 0 2 3 ...] (about a minute per row on 2 cores)
"""
from __future__ import annotations

import argparse
import math

from autopar.planner import gpt, plan
from autopar.planner.cluster import Cluster
from autopar.planner.megatron import HELD_OUT_ROWS, MEGATRON_TABLE_1, megatron_flops
from autopar.planner.model_profile import profile_model

EFFICIENCIES = [0.60 + 0.01 * i for i in range(21)]
NARROWS = [125.0 * i for i in range(13)]


def planned(row: tuple, profile: object, cluster: Cluster) -> float:
    size, heads, hidden, layers, tp, pp, gpus, batch, published = row
    result = plan(None, gpus, cluster=cluster, global_batch=batch, seq_len=2048, tp=(tp,), pp=(pp,), zero=(0,),
                  recompute=(True,), recompute_collectives=True, overlap_grad_sync=False, scatter_gather=True,
                  profile=profile)
    return megatron_flops(batch, layers, hidden) / result.best.step_time / gpus / 1e12


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", help="rows to fit (default: all but HELD_OUT_ROWS)",
                   default=[i for i in range(len(MEGATRON_TABLE_1)) if i not in HELD_OUT_ROWS])
    a = p.parse_args()
    base = Cluster.preset("dgx-a100")
    rows = [MEGATRON_TABLE_1[i] for i in a.rows]
    profiles = [profile_model(gpt(r[3], r[2], r[1]), tp_sizes=(r[4],)) for r in rows]
    best = None
    for eff in EFFICIENCIES:
        for narrow in NARROWS:
            cluster = base.replace(efficiency=eff, narrow=narrow)
            got = [planned(r, prof, cluster) for r, prof in zip(rows, profiles)]
            loss = sum(math.log(g / r[-1]) ** 2 for g, r in zip(got, rows))
            if best is None or loss < best[0]:
                best = (loss, eff, narrow, got)
    loss, eff, narrow, got = best
    print(f"best: efficiency={eff:.2f} narrow={narrow:.0f} (sum of squared log ratios {loss:.4f})")
    fitted = base.replace(efficiency=eff, narrow=narrow)
    for i, r in enumerate(MEGATRON_TABLE_1):
        if i in a.rows:
            g = got[a.rows.index(i)]
        else:
            g = planned(r, profile_model(gpt(r[3], r[2], r[1]), tp_sizes=(r[4],)), fitted)
        print(f"  {'fitted  ' if i in a.rows else 'held out'} {r[0]:>7.1f}B tp={r[4]} pp={r[5]:>2} GPUs={r[6]:>4}: "
              f"published {r[-1]} TFLOP/s, planned {g:.0f} ({g / r[-1] - 1:+.0%})")


if __name__ == "__main__":
    main()
