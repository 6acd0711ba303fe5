"""The planner against published ZeRO/FSDP, sequence-parallel and selective-recomputation runs: the error table.

Plans every run of ``autopar/planner/published.py`` (``RUNS``) with its mesh
and options fixed and prints, per run, the published figure, the planner's,
the error, whether a constant was fitted to it, and the configuration the
planner timed. ``--fit`` first fits the H100 preset's ``efficiency`` to the
``FITTED`` runs (bisection on the log ratio; every other constant fixed) and
prints it; the preset holds the result (``H100_500W_EFFICIENCY``), and the efficiency of compiled runs
fitted to the compiled one (``H100_500W_COMPILED_EFFICIENCY``).
``--markdown`` prints the table as docs/planner.md has it.
Run: python benchmarks/calibrate_published.py [--fit] [--markdown] [--runs NAME ...] (a few minutes on 2 cores)
"""
from __future__ import annotations

import argparse
import math

from autopar.planner.cluster import Cluster
from autopar.planner.model_profile import profile_model
from autopar.planner.published import FITTED, RUNS, build, error, predict, run_named

UNITS = {"tflops": "TFLOP/s per GPU", "seconds": "s per step", "tokens": "tokens/s per GPU"}


def fit_h100(profiles: dict, compiled: bool = False) -> float:
    """The efficiency at which the FITTED runs (eager, or ``compiled``) meet the published figures (geometric
    mean)."""
    runs = [r for r in map(run_named, FITTED) if r.compiled == compiled]
    base = Cluster.preset(runs[0].cluster)
    lo, hi = 0.2, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        cluster = base.replace(efficiency=mid)
        ratio = sum(math.log(1 + error(r, predict(r, profiles[r.model], cluster)[0])) for r in runs)
        lo, hi = (mid, hi) if ratio < 0 else (lo, mid)  # throughput figures rise with the efficiency
    return (lo + hi) / 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit", action="store_true", help="fit the H100 efficiency to the FITTED runs first")
    p.add_argument("--markdown", action="store_true", help="print docs/planner.md's table")
    p.add_argument("--runs", nargs="*", help="run names (default: all)")
    a = p.parse_args()
    runs = [run_named(n) for n in a.runs] if a.runs else list(RUNS)
    profiles: dict = {}
    for r in runs + ([run_named(n) for n in FITTED] if a.fit else []):
        key = r.model
        if key not in profiles or r.tp not in profiles[key].tp_sizes:
            sizes = tuple(sorted({x.tp for x in RUNS if x.model == key}))
            profiles[key] = profile_model(build(key), tp_sizes=sizes)
    if a.fit:
        print(f"fitted H100 efficiency: {fit_h100(profiles):.3f} eager (H100_500W_EFFICIENCY), "
              f"{fit_h100(profiles, compiled=True):.3f} compiled (H100_500W_COMPILED_EFFICIENCY)")
    if a.markdown:
        print("| run | source | GPUs | tp x pp | ZeRO | recompute | sp | published | planner | error | |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        got, est = predict(r, profiles[r.model])
        err = error(r, got)
        kind = "fitted" if r.name in FITTED else "**held out**"
        shown = f"{got:.3g}" if got < 1000 else f"{got:,.0f}"
        if a.markdown:
            print(f"| {r.name} | {r.source.split(' (')[0].split(',')[0]} | {r.gpus} | {r.tp} x {r.pp} | {r.zero} | "
                  f"{r.recompute} | {'yes' if r.sequence_parallel else '-'} | {r.published:g} {UNITS[r.metric]} | "
                  f"{shown} | {err:+.0%} | {kind} |")
        else:
            print(f"{kind:<12} {r.name:<28} published {r.published:>8g} {UNITS[r.metric]:<17} planner {got:>8.4g} "
                  f"({err:+.1%})  {est.config.describe()}", flush=True)


if __name__ == "__main__":
    main()
