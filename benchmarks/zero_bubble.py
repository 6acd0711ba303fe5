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
2. One stage's F, B and W in thread CPU time, measured in this process (other
   jobs on the cores stretch it far less than the ranks' wall-clock times), the
   cost of the split, and the simulator's bubble and pipeline time from those.
3. Step time of autopar's zb-h1 against torch.distributed.pipelining's
   ScheduleInterleavedZeroBubble (ZB1P) and ScheduleZBVZeroBubble (V placement,
   2 stages per rank) on the same chain and ranks (target <= 1.0). A torch
   schedule that fails is reported with its error and left out.

All runs of one pp share one job, and its steps are interleaved (order rotated
every step, a barrier before each): machine noise lands on every side alike.
The chain (benchmarks/pipeline_chain.py), float32, one intra-op thread per rank:
by default token ids into a small embedding, then transformer MLP blocks
(x + Linear(d, 4d) + GELU + Linear(4d, d), no biases; 8 blocks, d = 512, 128
rows per microbatch), where one action is some 20-25 ms of a core and a message
256 KiB; `--chain tanh` is the first chain (32 x Linear(512, 512) + Tanh, 32
rows), whose 3-5 ms actions make per-message costs weigh more. Ranks beyond the
machine's cores share them; the output says so.
Run: python benchmarks/zero_bubble.py [--pp 2] [--microbatches 8] [--steps 20] [--chain mlp|tanh]
     [--blocks B] [--width D] [--rows R]
(about 90 s on 2 idle cores, the tanh chain about 20 s; --pp 2 4 adds an oversubscribed pp=4)
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
from autopar.core.schedule import B, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Schedule, add_communication
from autopar.core.schedules import make_schedule
from autopar.core.simulate import simulate
from autopar.core.weight_grad import collect, split_linear
from pipeline_chain import Chain, Timeline, chain, chain_batch, cut_blocks, durations, mse, p2p_seconds, sgd
from pipeline_chain import add_chain_arguments, chain_sizes, header, step_fractions, torch_chain_step

AUTOPAR = ("1f1b", "zb-h1")
# torch schedule -> the stages rank r of p holds (of how many)
TORCH = {
    "ScheduleInterleavedZeroBubble": lambda r, p: ([r], p),
    "ScheduleInterleavedZeroBubble, 2 stages per rank": lambda r, p: ([r, r + p], 2 * p),
    "ScheduleZBVZeroBubble": lambda r, p: ([r, 2 * p - 1 - r], 2 * p),
}


def parallel_chain(args: argparse.Namespace, pp: int, schedule: str) -> Any:
    return autopar.parallelize(
        chain(args), autopar.Mesh(pp=pp), loss_fn=mse, optimizer=sgd, schedule=schedule,
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
    return {"p2p": p2p_seconds(args), "times": times, "timelines": timelines, "last": last}


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


def stage_cpu_seconds(args: argparse.Namespace, pp: int, repeats: int = 30) -> dict[str, float]:
    """Thread CPU seconds per microbatch of one stage's blocks, measured in this process, one thread.

    "F", "B": forward and whole backward with plain linears (1f1b); "F split",
    "B split", "W": with zb-h1's split linears, the backward split as the
    executor runs it; "W hooked": W when the weights have a post-accumulate-grad
    hook, as data-parallel gradient sync registers (a no-op hook here). Unlike the
    ranks' wall-clock timelines, CPU time does not grow while other jobs hold
    the cores.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    blocks = Chain(args.chain, args.width, args.blocks // pp).blocks
    weights = [p for p in blocks.parameters() if p.dim() == 2]  # the ones zb-h1 leaves to W
    x = torch.randn(args.rows, args.width, requires_grad=True)  # a received activation: its gradient goes back
    samples: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        start = time.thread_time()
        out = fn()
        samples.setdefault(name, []).append(time.thread_time() - start)
        return out

    def forward(linear: Callable[..., torch.Tensor]) -> torch.Tensor:
        h = x
        for block in blocks:
            h = block(h, linear)  # (rows, width)
        return h

    for _ in range(repeats):  # gradients keep accumulating, as over a step's microbatches
        y = timed("F", lambda: forward(torch.nn.functional.linear))
        timed("B", lambda: y.sum().backward())
        for hooked in (False, True):
            hooks = [w.register_post_accumulate_grad_hook(lambda p: None) for w in weights] if hooked else []
            y = timed("F split", lambda: forward(split_linear))
            with collect() as deferred:
                timed("B split", lambda: y.sum().backward())
            timed("W hooked" if hooked else "W", deferred.run)
            for hook in hooks:
                hook.remove()
    torch.set_num_threads(threads)
    return {name: statistics.median(times[2:]) for name, times in samples.items()}


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
    row["step"], row["quickest"] = step_times(results, schedule)
    return row


def step_times(results: list[dict], name: str) -> tuple[float, float]:
    """The median over ranks of each rank's median step time, and of its quickest."""
    return tuple(statistics.median(f(r["times"][name]) for r in results) for f in (statistics.median, min))


def verdict(ok: bool, oversubscribed: bool) -> str:
    return "not judged: oversubscribed" if oversubscribed else "met" if ok else "MISSED"


def print_pp(results: list[dict], failed: dict[str, str], pp: int, args: argparse.Namespace, cores: int) -> None:
    m, over = args.microbatches, pp > cores
    print(f"pp={pp}, {m} microbatches" + (f" (OVERSUBSCRIBED: {pp} ranks on {cores} cores; a rank waiting for a core "
                                          f"inside F, B or W counts as busy)" if over else ""))
    print(f"  {'schedule':<8} {'theory':>6}  {'simulated':>9}  {'measured':>8}  {'in RECV':>7}  {'in SEND':>7}"
          f"  {'F ms':>6}  {'B ms':>6}  {'W ms':>6}  {'step ms':>8}  {'quickest':>8}")
    rows = {s: bubble_row(results, pp, args, s) for s in AUTOPAR}
    for s, r in rows.items():
        print(f"  {s:<8} {theory(s, pp, m):>6.1%}  {r['simulated']:>9.1%}  {r['measured']:>8.1%}  {r['recv']:>7.1%}"
              f"  {r['send']:>7.1%}  {r['F'] * 1e3:>6.2f}  {r['B'] * 1e3:>6.2f}  {r['W'] * 1e3:>6.2f}"
              f"  {r['step'] * 1e3:>8.1f}  {r['quickest'] * 1e3:>8.1f}")
    zb, base = rows["zb-h1"], rows["1f1b"]
    bubble = zb["measured"] / base["measured"]
    step = zb["step"] / base["step"]
    print(f"  bubble zb-h1 / 1f1b: measured {bubble:.3f} (target <= 0.5: {verdict(bubble <= 0.5, over)}), "
          f"simulated {zb['simulated'] / base['simulated']:.3f}, "
          f"theory {theory('zb-h1', pp, m) / theory('1f1b', pp, m):.3f}")
    print(f"  step time zb-h1 / 1f1b: {step:.3f} (target < 1.0: {verdict(step < 1.0, over)}); quickest steps "
          f"{zb['quickest'] / base['quickest']:.3f}")
    print(f"  p2p: {results[0]['p2p'] * 1e3:.3f} ms one way per activation ({args.rows * args.width * 4 // 1024} KiB)")
    print_cpu(stage_cpu_seconds(args, pp), pp, args, results[0]["p2p"])
    print("  against torch.distributed.pipelining (same chain, ranks, microbatches; step time, median over ranks of"
          " each rank's median; and of its quickest step):")
    print(f"    {'torch schedule':<50} {'torch ms':>8}  {'autopar zb-h1 / torch':>21}  {'quickest':>8}"
          f"  {'loss diff':>9}  target <= 1.0")
    for name in TORCH:
        if name in failed:
            print(f"    {name:<50} fails on {failed[name]}")
        elif name in args.torch:
            t, quickest = step_times(results, name)
            diff = abs(results[0]["last"]["zb-h1"] - results[0]["last"][name])
            ratio = zb["step"] / t
            print(f"    {name:<50} {t * 1e3:>8.1f}  {ratio:>21.3f}  {zb['quickest'] / quickest:>8.3f}  {diff:>9.1e}"
                  f"  {verdict(ratio <= 1.0, over)}")


def print_cpu(cpu: dict[str, float], pp: int, args: argparse.Namespace, p2p: float) -> None:
    """One stage's compute per microbatch in CPU time, and what the simulator makes of it."""
    ms = {k: v * 1e3 for k, v in cpu.items()}
    print(f"  one stage ({args.blocks // pp} blocks) per microbatch, thread CPU time in one process: 1f1b F "
          f"{ms['F']:.2f} ms, B {ms['B']:.2f} ms; zb-h1 F {ms['F split']:.2f} ms, B {ms['B split']:.2f} ms, "
          f"W {ms['W']:.2f} ms (with a gradient hook on every weight, as data parallelism has: "
          f"{ms['W hooked']:.2f} ms)")
    split = cpu["F split"] + cpu["B split"] + cpu["W"]
    print(f"    W is {cpu['W'] / (cpu['B split'] + cpu['W']):.0%} of zb-h1's backward; zb-h1 computes "
          f"{split / (cpu['F'] + cpu['B']) - 1:+.1%} per microbatch (F {cpu['F split'] / cpu['F'] - 1:+.1%}, "
          f"B + W {(cpu['B split'] + cpu['W']) / cpu['B'] - 1:+.1%})")
    sims = {
        "1f1b": simulate(lowered("1f1b", pp, args.microbatches), forward_time=cpu["F"], backward_time=cpu["B"],
                         comm_time=p2p),
        "zb-h1": simulate(lowered("zb-h1", pp, args.microbatches), forward_time=cpu["F split"],
                          backward_time=cpu["B split"] + cpu["W"], weight_time=cpu["W"], comm_time=p2p),
    }
    zb, base = sims["zb-h1"].bubble_fraction, sims["1f1b"].bubble_fraction
    print(f"    simulated with these times and the p2p time (cores to themselves): bubble 1f1b {base:.1%}, zb-h1 "
          f"{zb:.1%} (ratio {zb / base:.3f}); pipeline time zb-h1 / 1f1b "
          f"{sims['zb-h1'].makespan / sims['1f1b'].makespan:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, nargs="+", default=[2], help="pipeline ranks (beyond the cores: oversubscribed)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="measured steps of every run")
    add_chain_arguments(p, default="mlp")
    p.add_argument("--torch", nargs="*", default=list(TORCH), choices=list(TORCH), metavar="SCHEDULE",
                   help=f"torch schedules to compare with (default all: {', '.join(TORCH)})")
    args = chain_sizes(p.parse_args())

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
