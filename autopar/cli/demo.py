"""``autopar demo``: train a small GPT on local CPU ranks beside a single-device run."""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from autopar.core.mesh import Mesh
from autopar.core.schedule import B, F, W, add_communication
from autopar.core.schedules import make_schedule
from autopar.core.simulate import simulate

Timeline = list[tuple[str, float, float]]  # (action, start, end) of one rank's step


def demo_model(layers: int, width: int, vocab: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=128, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).train()


def next_token_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # (B, S, V)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))


def adamw(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def batches(steps: int, batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, vocab, (steps, batch, 1), generator=g)  # a toy language: sequences count up
    return list((starts + torch.arange(seq)) % vocab)


def bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def zero_bubble_beside(args: argparse.Namespace) -> str | None:
    """Why the demo does not compare 1F1B with zb-h1, or None when it does."""
    if args.no_zero_bubble:
        return "--no-zero-bubble"
    if (os.cpu_count() or 1) < 2:
        return "one core: a pipeline's ranks would take turns on it, and no schedule could fill the other's waits"
    return None


def _train(mesh: Mesh, args: argparse.Namespace, reference: list[float], schedule: str, show: bool) -> tuple:
    """Trains the demo model with ``schedule``; (the model, seconds, largest difference from single-device, this
    rank's timeline of every step)."""
    from autopar.parallel import parallelize

    pm = parallelize(demo_model(args.layers, args.width, args.vocab), mesh, loss_fn=next_token_loss,
                     optimizer=adamw, microbatches=args.microbatches, schedule=schedule, zero=args.zero)
    start = time.perf_counter()
    worst = 0.0
    timelines = []
    for i, ids in enumerate(batches(args.steps, args.batch, args.seq, args.vocab)):
        loss = pm.step(ids, target=ids)
        timelines.append(pm.timeline())
        worst = max(worst, abs(loss - reference[i]))
        if show:
            print(f"  {bar(i + 1, args.steps)}  loss {loss:.6f}   single-device {reference[i]:.6f}", flush=True)
    return pm, time.perf_counter() - start, worst, timelines


def _rank(mesh: Mesh, args: argparse.Namespace, reference: list[float]) -> dict:
    import torch.distributed as dist

    rank0 = dist.get_rank() == 0
    pm, seconds, worst, steps = _train(mesh, args, reference, args.schedule, rank0)
    return {"time": seconds, "worst": worst, "plan": pm.plan.summary() if rank0 else "", "timeline": pm.timeline(),
            "steps": steps, "memory": pm.memory(), "comm": pm.communication()}


def run(argv: list[str]) -> int:
    from autopar.cli.arguments import parse_mesh
    from autopar.runtime.launch import launch
    from autopar.runtime.trace import save_chrome_trace, save_gantt

    p = argparse.ArgumentParser(prog="autopar demo", description="train a small GPT on local CPU ranks")
    p.add_argument("--mesh", default="dp=2,pp=2,tp=2", help="mesh axes (default dp=2,pp=2,tp=2)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over dp (default 0)")
    p.add_argument("--no-zero-bubble", action="store_true",
                   help="do not compare 1F1B with the zero-bubble schedule zb-h1 on 2 pipeline ranks afterwards")
    p.add_argument("--compare-width", type=int, default=256,
                   help="width of the model the schedule comparison trains (default 256: see docs/decisions.md)")
    p.add_argument("--out", default=".", help="folder for the timeline pictures")
    args = p.parse_args(argv)
    mesh = parse_mesh(args.mesh)
    zero = f", zero={args.zero}" if args.zero else ""
    print(f"autopar demo: GPT-2 ({args.layers} layers, width {args.width}, vocab {args.vocab}) on {mesh}{zero}, "
          f"{mesh.size} local CPU ranks; global batch {args.batch} x {args.seq}; {args.steps} steps")
    model = demo_model(args.layers, args.width, args.vocab)
    opt = adamw(list(model.parameters()))
    reference = []
    t0 = time.perf_counter()
    for ids in batches(args.steps, args.batch, args.seq, args.vocab):
        loss = next_token_loss(model(ids), ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        reference.append(float(loss.detach()))
    single = time.perf_counter() - t0
    results = launch(_rank, mesh.size, mesh, args, reference, device="cpu")
    r0 = results[0]
    print(f"\ndone: {args.steps} steps in {r0['time']:.2f} s on {mesh.size} ranks, first step's compile included "
          f"(single device: {single:.2f} s); largest loss difference {max(r['worst'] for r in results):.2e}")
    comm = r0["comm"]
    if comm:
        print("measured tensor-parallel traffic of rank 0: "
              + ", ".join(f"{k} {v / args.steps / 1024:.1f} KiB/step" for k, v in sorted(comm.items())))
    print("measured memory per rank (parameters / gradients / optimizer state, KiB):")
    for rank, r in enumerate(results):
        m = r["memory"]
        print(f"  rank {rank}: " + " / ".join(f"{m.get(k, 0) / 1024:.0f}" for k in ("parameters", "gradients", "optimizer")))
    print(r0["plan"])
    timelines = {rank: r["timeline"] for rank, r in enumerate(results) if r["timeline"]}
    if timelines:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        trace = save_chrome_trace(timelines, out / "autopar-timeline.json")
        print(f"pipeline timeline of the last step: {trace} (open in https://ui.perfetto.dev)", end="")
        try:
            print(f", {save_gantt(timelines, out / 'autopar-timeline.png', f'autopar demo, {mesh}, last step')}")
        except RuntimeError as e:
            print(f"; no PNG: {e}")
    reason = zero_bubble_beside(args)
    if reason is None:
        compare_schedules(args, Path(args.out))
    else:
        print(f"schedule comparison skipped: {reason}")
    return 0


COMPARED = ("1f1b", "zb-h1")


ROWS, SEQ = 16, 64  # each microbatch of the comparison: enough work per action that messages do not dominate


def _compare_rank(args: argparse.Namespace, microbatches: int, steps: int) -> dict:
    """Both schedules on pp=2, their steps interleaved (after one compiling step each): times and timelines."""
    from autopar.parallel import parallelize

    torch.set_num_threads(1)
    ids = batches(1, microbatches * ROWS, SEQ, args.vocab)[0]
    models = {s: parallelize(demo_model(args.layers, args.compare_width, args.vocab), Mesh(pp=2), loss_fn=next_token_loss,
                             optimizer=adamw, microbatches=microbatches, schedule=s) for s in COMPARED}
    out: dict = {s: {"times": [], "steps": []} for s in COMPARED}
    for i in range(steps + 1):
        for s in COMPARED if i % 2 else reversed(COMPARED):
            torch.distributed.barrier()  # (both ranks start each step together, so the span is the pipeline's)
            start = time.perf_counter()
            models[s].step(ids, target=ids)
            if i:
                out[s]["times"].append(time.perf_counter() - start)
                out[s]["steps"].append(models[s].timeline())
    return out


def compare_schedules(args: argparse.Namespace, out: Path, microbatches: int = 4, steps: int = 10) -> None:
    """1F1B beside zb-h1 where the comparison means something: 2 pipeline ranks on 2 or more cores, a GPT-2 wide
    enough that the weight gradients are their usual share of a backward (``--compare-width``, 256), and 4
    microbatches, where 1F1B's bubble is the textbook 1/5 (docs/decisions.md, "The demo's schedule comparison").
    Per schedule: the median step time, and the bubble measured (1 - the compute time of each rank's pipeline
    actions over their span, the median step) beside the one simulated with the measured F, B and W times."""
    from autopar.runtime.launch import launch
    from autopar.runtime.trace import save_gantts

    print(f"\n1F1B beside the zero-bubble schedule zb-h1 (each backward split into B, the input gradients the previous "
          f"stage waits for, and W, the weight gradients, which fill the waits): pp=2 on 2 ranks "
          f"({os.cpu_count()} cores), GPT-2 of width {args.compare_width}, {microbatches} microbatches of {ROWS} x {SEQ}, "
          f"{steps} steps each, interleaved")
    results = launch(_compare_rank, 2, args, microbatches, steps, device="cpu")
    rows = {}
    for s in COMPARED:
        steps_of = [r[s]["steps"] for r in results]
        measured = statistics.median(measured_bubble({rank: tl[k] for rank, tl in enumerate(steps_of)})
                                     for k in range(steps))
        times = {k: statistics.median(_durations(steps_of, k)) if _durations(steps_of, k) else None for k in "FBW"}
        sim = simulate(add_communication(make_schedule(s, 2, microbatches)), forward_time=times["F"],
                       backward_time=times["B"] + (times["W"] or 0.0), weight_time=times["W"]).bubble_fraction
        step = statistics.median(statistics.median(r[s]["times"]) for r in results)
        rows[s] = (step, times)
        print(f"  {s:<6} step {step * 1e3:7.1f} ms   bubble measured {measured:6.1%}   simulated {sim:6.1%} "
              f"(F {times['F'] * 1e3:.1f} ms, B {times['B'] * 1e3:.1f} ms"
              + (f", W {times['W'] * 1e3:.1f} ms)" if times["W"] else ")"))
    pairs = [z / b for r in results for z, b in zip(r["zb-h1"]["times"], r["1f1b"]["times"])]
    print("  " + verdict(rows, statistics.median(pairs)))
    print("  " + free_split_bound(rows, microbatches))
    panels = {f"{s}, pp=2: pipeline actions of the quickest step": quickest_step([r[s]["steps"] for r in results])
              for s in COMPARED}
    try:
        print(f"  the quickest step of 1f1b above that of zb-h1: {save_gantts(panels, out / 'autopar-zero-bubble.png')}")
    except RuntimeError as e:
        print(f"  no PNG: {e}")


def verdict(rows: dict[str, tuple[float, dict[str, float | None]]], ratio: float) -> str:
    """What the measured steps say: ``ratio``, zb-h1's step time over 1F1B's (the median over the pairs of steps
    run one after the other, which slow changes of the machine's speed touch alike), and whether the split
    backward paid for itself."""
    (_, t1), (_, t2) = rows["1f1b"], rows["zb-h1"]
    split = (t2["B"] + t2["W"]) / t1["B"] - 1
    if ratio < 1:
        return (f"zb-h1 / 1f1b step time {ratio:.2f}, the median over pairs of steps: the weight gradients fill the "
                f"waits (the split backward B + W costs {split:+.0%} against 1F1B's B)")
    return (f"zb-h1 / 1f1b step time {ratio:.2f}, the median over pairs of steps: here the split backward's B + W "
            f"costs {split:+.0%} against "
            f"1F1B's B, more than the bubble it fills; it pays where deferring W costs little (docs/benchmarks.md: "
            f"the zero-bubble benchmark's chain)")


def free_split_bound(rows: dict[str, tuple[float, dict[str, float | None]]], microbatches: int) -> str:
    """The best zb-h1 / 1f1b this setting allows: both schedules simulated (no transfer time) with 1F1B's
    measured F and B, and zb-h1's W share of the backward, as if the split cost nothing (B + W = 1F1B's B)."""
    (_, t1), (_, t2) = rows["1f1b"], rows["zb-h1"]
    forward, backward = t1["F"], t1["B"]
    weight = backward * t2["W"] / (t2["B"] + t2["W"])
    spans = {s: simulate(add_communication(make_schedule(s, 2, microbatches)), forward_time=forward,
                         backward_time=backward, weight_time=weight if s == "zb-h1" else None).makespan
             for s in COMPARED}
    return (f"with a split that cost nothing (B + W = 1F1B's B, W {weight / backward:.0%} of it) zb-h1 / 1f1b "
            f"would be {spans['zb-h1'] / spans['1f1b']:.3f} here (the simulator, transfers free; in closed form "
            f"1 - 2 (p - 1) W / ((m + p - 1)(F + B)) for p = 2, m = {microbatches})")


def measured_bubble(timelines: dict[int, Timeline]) -> float:
    """The mean over ranks of 1 - (F, B and W time) / span, the span running from the step's first pipeline
    action on any rank to its last on any rank (perf_counter is one clock for the machine's processes): a rank
    that starts late or finishes early counts its wait as bubble, as the simulator's ``bubble_fraction`` does."""
    from autopar.runtime.trace import kind, pipeline_part

    parts = [pipeline_part(tl) for tl in timelines.values()]
    span = max(e for part in parts for *_, e in part) - min(b for part in parts for _, b, _ in part)
    return sum(1 - sum(e - b for a, b, e in part if kind(a) in (F, B, W)) / span for part in parts) / len(parts)


def _durations(steps_of: list[list[Timeline]], k: str) -> list[float]:
    from autopar.runtime.trace import kind

    return [e - b for per_rank in steps_of for tl in per_rank for a, b, e in tl if kind(a) == k]


def quickest_step(steps: list[list[Timeline]]) -> dict[int, Timeline]:
    """Of every rank's timelines of the same steps (``steps[rank][step]``), the pipeline actions of the step with
    the shortest span over the ranks; the first step, which compiles, only if it is the only one. Timing noise
    (other processes on the cores) lengthens steps, so the quickest shows the schedule best."""
    from autopar.runtime.trace import pipeline_part, span

    def of(k: int) -> dict[int, Timeline]:
        return {rank: pipeline_part(per_step[k]) for rank, per_step in enumerate(steps)}

    return min((of(k) for k in range(min(1, len(steps[0]) - 1), len(steps[0]))), key=span)
