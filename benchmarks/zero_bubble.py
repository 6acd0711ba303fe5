"""Zero-bubble pipeline (zb-h1) against 1F1B and torch's zero-bubble schedules, on local gloo CPU ranks.

Prints, for each pp:

1. The bubble of autopar's 1f1b and zb-h1 on the same chain, cuts and
   microbatches: measured (per step, 1 - time in F, B and W actions / span of
   the step's pipeline actions, averaged over ranks; median over steps),
   simulated (`autopar.core.simulate` on the executed schedule, fed with the
   median measured F, B, W and point-to-point times) and the textbook value
   for F = B = W; the median F, B and W times and step times.
   Then the ratios zb-h1 / 1f1b of bubble (target <= 0.5) and step time
   (target < 1.0).
2. Step time of autopar's zb-h1 against torch.distributed.pipelining's
   ScheduleInterleavedZeroBubble (ZB1P) and ScheduleZBVZeroBubble (V placement,
   2 stages per rank) on the same chain and ranks (target <= 1.0). A torch
   schedule that fails is reported with its error and left out.

All runs of one pp share one job, and its steps are interleaved (order rotated
every step, a barrier before each): machine noise lands on every side alike.
The chain: wide Linear+Tanh blocks in float32, one intra-op thread per rank.
Ranks beyond the machine's cores share them; the output says so.
Run: python benchmarks/zero_bubble.py [--pp 2] [--microbatches 8] [--steps 20] [--blocks 32] [--width 512]
(under a minute on 2 idle cores, a few minutes on busy ones; --pp 2 4 adds an oversubscribed pp=4)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import autopar
from autopar.core.schedule import B, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Schedule, add_communication, make_schedule
from autopar.core.simulate import simulate
from pipeline_chain import Chain, Timeline, chain_batch, cut_blocks, durations, mse, p2p_seconds, sgd, step_fractions
from pipeline_chain import add_chain_arguments, header, torch_chain_step

AUTOPAR = ("1f1b", "zb-h1")
# torch schedule -> the stages rank r of p holds (of how many)
TORCH = {
    "ScheduleInterleavedZeroBubble": lambda r, p: ([r], p),
    "ScheduleInterleavedZeroBubble, 2 stages per rank": lambda r, p: ([r, r + p], 2 * p),
    "ScheduleZBVZeroBubble": lambda r, p: ([r, 2 * p - 1 - r], 2 * p),
}


def parallel_chain(args: argparse.Namespace, pp: int, schedule: str) -> Any:
    return autopar.parallelize(
        Chain(args.width, args.blocks), autopar.Mesh(pp=pp), loss_fn=mse, optimizer=sgd, schedule=schedule,
        microbatches=args.microbatches, split_points=[f"blocks.{b}" for b in cut_blocks(args.blocks, pp)],
    )


def torch_step(args: argparse.Namespace, pp: int, name: str) -> Callable[[], float]:
    """A step of torch's schedule ``name``; a failure is raised as one line naming the schedule."""
    import torch.distributed.pipelining as pipelining

    stage_ids, n_stages = TORCH[name](dist.get_rank(), pp)
    cls = getattr(pipelining, name.split(",")[0])
    try:
        step = torch_chain_step(args, cls, args.microbatches, stage_ids, n_stages)
    except Exception as e:
        raise RuntimeError(f"{name}: {one_line(e)}") from e

    def checked() -> float:
        try:
            return step()
        except Exception as e:
            raise RuntimeError(f"{name}: {one_line(e)}") from e

    return checked


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _rank(args: argparse.Namespace, pp: int, torch_names: list[str]) -> dict:
    """Every run's step times (and autopar's timelines), steps interleaved; the last loss of each run."""
    torch.set_num_threads(1)
    x, y = chain_batch(args, args.microbatches)
    runs: dict[str, Callable[[], float]] = {}
    models = {}
    for schedule in AUTOPAR:
        models[schedule] = pm = parallel_chain(args, pp, schedule)
        runs[schedule] = lambda pm=pm: pm.step(x, target=y)
    for name in torch_names:
        runs[name] = torch_step(args, pp, name)
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    timelines: dict[str, list[Timeline]] = {n: [] for n in AUTOPAR}
    last: dict[str, float] = {}
    for i in range(args.warmup + args.steps):
        for name in names[i % len(names):] + names[: i % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            last[name] = runs[name]()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
                if name in models:
                    timelines[name].append(models[name].timeline())
    return {"p2p": p2p_seconds(args), "times": {n: statistics.median(t) for n, t in times.items()},
            "timelines": timelines, "last": last}


def run_pp(args: argparse.Namespace, pp: int) -> tuple[list[dict], dict[str, str]]:
    """The ranks' results at ``pp``; torch schedules that failed, with their errors (the job is rerun without)."""
    names = [n for n in TORCH if n in args.torch]
    failed: dict[str, str] = {}
    while True:
        try:
            return autopar.launch(_rank, pp, args, pp, names), failed
        except autopar.RankError as e:
            line = next((ln.removeprefix("RuntimeError: ") for ln in reversed(e.detail.strip().splitlines())
                         if ln.removeprefix("RuntimeError: ").split(":")[0] in names), None)
            if line is None:
                raise
            name, error = line.split(": ", 1)
            failed[name] = f"rank {e.rank}: {error}"
            names.remove(name)


# ---------------------------------------------------------------------------
# Reading the results
# ---------------------------------------------------------------------------


def lowered(schedule: str, pp: int, m: int) -> Schedule:
    return add_communication(make_schedule(schedule, pp, m))


def theory(schedule: str, pp: int, m: int) -> float:
    """The bubble with free communication and F = B = W (1F1B: (p-1)/(m+p-1); ZB-H1: (p-1)/(3m+p-1))."""
    return (pp - 1) / ((3 if schedule == "zb-h1" else 1) * m + pp - 1)


def bubble_row(results: list[dict], pp: int, args: argparse.Namespace, schedule: str) -> dict[str, float]:
    m = args.microbatches
    per_step = [[r["timelines"][schedule][k] for r in results] for k in range(args.steps)]
    everything = [tl for step in per_step for tl in step]
    row = {"F": durations(everything, F), "B": durations(everything, B)}
    row["W"] = durations(everything, W) if schedule == "zb-h1" else 0.0
    row["simulated"] = simulate(lowered(schedule, pp, m), forward_time=row["F"], backward_time=row["B"] + row["W"],
                                comm_time=results[0]["p2p"], weight_time=row["W"] or None).bubble_fraction
    fractions = [step_fractions(step, ((RECV_F, RECV_B), (SEND_F, SEND_B))) for step in per_step]
    row["measured"], row["recv"], row["send"] = (statistics.median(f[i] for f in fractions) for i in range(3))
    row["step"] = statistics.median(r["times"][schedule] for r in results)
    return row


def verdict(ok: bool, oversubscribed: bool) -> str:
    return "not judged: oversubscribed" if oversubscribed else "met" if ok else "MISSED"


def print_pp(results: list[dict], failed: dict[str, str], pp: int, args: argparse.Namespace, cores: int) -> None:
    m, over = args.microbatches, pp > cores
    print(f"pp={pp}, {m} microbatches" + (f" (OVERSUBSCRIBED: {pp} ranks on {cores} cores; a rank waiting for a core "
                                          f"inside F, B or W counts as busy)" if over else ""))
    print(f"  {'schedule':<8} {'theory':>6}  {'simulated':>9}  {'measured':>8}  {'in RECV':>7}  {'in SEND':>7}"
          f"  {'F ms':>6}  {'B ms':>6}  {'W ms':>6}  {'step ms':>8}")
    rows = {s: bubble_row(results, pp, args, s) for s in AUTOPAR}
    for s, r in rows.items():
        print(f"  {s:<8} {theory(s, pp, m):>6.1%}  {r['simulated']:>9.1%}  {r['measured']:>8.1%}  {r['recv']:>7.1%}"
              f"  {r['send']:>7.1%}  {r['F'] * 1e3:>6.2f}  {r['B'] * 1e3:>6.2f}  {r['W'] * 1e3:>6.2f}"
              f"  {r['step'] * 1e3:>8.1f}")
    zb, base = rows["zb-h1"], rows["1f1b"]
    bubble = zb["measured"] / base["measured"]
    step = zb["step"] / base["step"]
    print(f"  bubble zb-h1 / 1f1b: measured {bubble:.3f} (target <= 0.5: {verdict(bubble <= 0.5, over)}), "
          f"simulated {zb['simulated'] / base['simulated']:.3f}, "
          f"theory {theory('zb-h1', pp, m) / theory('1f1b', pp, m):.3f}")
    print(f"  step time zb-h1 / 1f1b: {step:.3f} (target < 1.0: {verdict(step < 1.0, over)})")
    print(f"  p2p: {results[0]['p2p'] * 1e3:.3f} ms one way per activation ({args.rows * args.width * 4 // 1024} KiB)")
    print("  against torch.distributed.pipelining (same chain, ranks, microbatches; step time, median over ranks of"
          " each rank's median):")
    print(f"    {'torch schedule':<50} {'torch ms':>8}  {'autopar zb-h1 / torch':>21}  {'loss diff':>9}  target <= 1.0")
    for name in TORCH:
        if name in failed:
            print(f"    {name:<50} fails on {failed[name]}")
        elif name in args.torch:
            t = statistics.median(r["times"][name] for r in results)
            diff = abs(results[0]["last"]["zb-h1"] - results[0]["last"][name])
            ratio = zb["step"] / t
            print(f"    {name:<50} {t * 1e3:>8.1f}  {ratio:>21.3f}  {diff:>9.1e}  {verdict(ratio <= 1.0, over)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, nargs="+", default=[2], help="pipeline ranks (beyond the cores: oversubscribed)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="measured steps of every run")
    add_chain_arguments(p)
    p.add_argument("--torch", nargs="*", default=list(TORCH), choices=list(TORCH), metavar="SCHEDULE",
                   help=f"torch schedules to compare with (default all: {', '.join(TORCH)})")
    args = p.parse_args()

    cores = os.cpu_count() or 1
    began = time.perf_counter()
    print(header("zero-bubble", args) + f", then {args.steps} measured steps, every run's interleaved")
    print("bubble: measured = mean over ranks of 1 - F/B/W time / span of the step's pipeline actions, median over "
          "steps; 'in RECV'/'in SEND' its shares in receives/sends; simulated = autopar.core.simulate with the median "
          "F, B, W and p2p times; theory = F = B = W, free communication\n")
    for pp in args.pp:
        results, failed = run_pp(args, pp)
        print_pp(results, failed, pp, args, cores)
        print()
    print(f"total {time.perf_counter() - began:.0f} s; load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
