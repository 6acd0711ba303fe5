"""autopar's pipeline on local gloo CPU ranks: bubble, in-flight activations, speed against torch, skip connections.

Prints four results:

1. The measured bubble fraction of every schedule (gpipe, 1f1b, interleaved-1f1b
   with 2 stages per rank) for each pp and microbatch count, beside the theory
   ((p-1)/(m+p-1); (p-1)/(v*m+p-1) interleaved) and beside `autopar.core.simulate`
   fed with the measured F, B and point-to-point times. Measured: per step,
   1 - (time a rank spends inside F and B actions) / (the step's span, from the
   first action start on any rank to the last action end on any rank),
   averaged over ranks; the median over the measured steps.
2. Peak in-flight microbatches per stage (activations held between F and B):
   GPipe holds m, 1F1B at most p - stage.
3. Step time of autopar against torch.distributed.pipelining (PipelineStage +
   ScheduleGPipe / Schedule1F1B) on the same skip-free chain, ranks, cuts and
   microbatches, steps interleaved, medians, as a ratio (target <= 1.0).
4. A LLaMA (random weights) whose RoPE cos/sin, made once, feed every layer:
   what torch.distributed.pipelining does with it at 2 and 4 stages, and
   autopar's losses against single-device training.

The chain model is wide Linear+Tanh blocks in float32 (``--chain mlp``: transformer
MLP blocks, see benchmarks/pipeline_chain.py), one intra-op thread per rank, so
that compute dominates communication. Ranks beyond the machine's cores share
them; the output says so.
Run: python benchmarks/pipeline.py [--pp 2 4] [--microbatches 4 8] [--steps 8] [--blocks 32] [--width 512]
(about 2 minutes on 2 cores; --blocks 64 --width 1024 --steps 20 --compare-pp 2 4 for a bigger run)
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.core.schedule import B as BACKWARD
from autopar.core.schedule import F as FORWARD
from autopar.core.schedule import RECV_B, RECV_F, SEND_B, SEND_F, Schedule, add_communication
from autopar.core.schedules import make_schedule
from autopar.core.simulate import simulate
from autopar.testing import reference_run
from pipeline_chain import Timeline, chain, chain_batch, cut_blocks, durations, mse, p2p_seconds, sgd, step_fractions
from pipeline_chain import add_chain_arguments, chain_sizes, header, torch_chain_step

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


# ---------------------------------------------------------------------------
# Models, losses, optimizers (module level: the ranks unpickle them by value)
# ---------------------------------------------------------------------------


class Llama(nn.Module):
    """A small random-weight LLaMA returning logits; RoPE cos/sin are computed once and used by every layer."""

    def __init__(self, layers: int, seed: int = 0) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, use_cache=False,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
        self.lm = LlamaForCausalLM(cfg).double().train()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids).logits  # (B, S, vocab)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def llama_sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)  # large enough that the loss visibly moves in a few steps


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule == "interleaved-1f1b" else 1


def runs(args: argparse.Namespace, pp: int) -> list[tuple[str, int]]:
    """The (schedule, microbatches) pairs measured at ``pp``; interleaved needs m to be a multiple of pp."""
    return [(s, m) for s in SCHEDULES for m in args.microbatches if s != "interleaved-1f1b" or m % pp == 0]


def parallel_chain(args: argparse.Namespace, pp: int, schedule: str, m: int) -> Any:
    v = stages_per_rank(schedule)
    return autopar.parallelize(
        chain(args), autopar.Mesh(pp=pp), loss_fn=mse, optimizer=sgd, schedule=schedule,
        microbatches=m, stages_per_rank=v, split_points=[f"blocks.{b}" for b in cut_blocks(args.blocks, pp * v)],
    )


# ---------------------------------------------------------------------------
# Per-rank work
# ---------------------------------------------------------------------------


def _bubble_rank(args: argparse.Namespace, pp: int) -> dict:
    """Per (schedule, m): this rank's timeline of every measured step and its peak in-flight microbatches."""
    torch.set_num_threads(1)
    out: dict[Any, Any] = {"p2p": p2p_seconds(args)}
    for schedule, m in runs(args, pp):
        pm = parallel_chain(args, pp, schedule, m)
        x, y = chain_batch(args, m)
        timelines: list[Timeline] = []
        for i in range(args.warmup + args.steps):
            dist.barrier()
            pm.step(x, target=y)
            if i >= args.warmup:
                timelines.append(pm.timeline())
        out[(schedule, m)] = {"timelines": timelines, "peak": dict(pm.runtime.executor.peak_in_flight)}
    return out


def _versus_torch_rank(args: argparse.Namespace, pp: int) -> dict:
    """Median step times of autopar and torch, interleaved, per (schedule, m); the last loss of each."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    out = {}
    for schedule, schedule_cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        for m in args.microbatches:
            pm = parallel_chain(args, pp, schedule, m)
            x, y = chain_batch(args, m)
            steps = {"autopar": lambda: pm.step(x, target=y), "torch": torch_chain_step(args, schedule_cls, m, [dist.get_rank()], pp)}
            times: dict[str, list[float]] = {"autopar": [], "torch": []}
            last: dict[str, float] = {}
            for i in range(args.warmup + args.compare_steps):
                for name in sorted(steps, reverse=i % 2 == 1):
                    dist.barrier()
                    start = time.perf_counter()
                    last[name] = steps[name]()
                    if i >= args.warmup:
                        times[name].append(time.perf_counter() - start)
            out[(schedule, m)] = {k: statistics.median(v) for k, v in times.items()} | {"last": last}
    return out


def _skip_autopar_rank(args: argparse.Namespace, pp: int) -> list[float]:
    torch.set_num_threads(1)
    ids, target = llama_batch()
    pm = autopar.parallelize(Llama(args.llama_layers), autopar.Mesh(pp=pp), loss_fn=lm_loss, optimizer=llama_sgd,
                             schedule="1f1b", microbatches=4, split_points=llama_cuts(args.llama_layers, pp))
    return [pm.step(ids, target=target) for _ in range(args.llama_steps)]


def _torch_schedule_step(schedule: Any, opt: torch.optim.Optimizer, rank: int, pp: int, inputs: torch.Tensor,
                         target: torch.Tensor) -> float:
    """One step of a torch.distributed.pipelining schedule and the optimizer; the mean loss, on every rank."""
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(inputs, return_outputs=False)
    elif rank == pp - 1:
        schedule.step(target=target, losses=losses, return_outputs=False)
    else:
        schedule.step(return_outputs=False)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = torch.stack(losses).detach().double().mean() if losses else torch.zeros((), dtype=torch.float64)
    dist.broadcast(loss, src=pp - 1)  # autopar's step returns the global loss on every rank too
    return float(loss)


def _skip_torch_rank(args: argparse.Namespace, pp: int) -> list[float]:
    """torch.distributed.pipelining's tracing front end (``pipeline`` + ``SplitPoint``) on the same LLaMA.

    A failure is raised as one line, so that the launcher stops the job at once
    (peers blocked in a receive would otherwise wait for the gloo timeout).
    """
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, build_stage, pipeline

    torch.set_num_threads(1)
    ids, target = llama_batch()
    rank = dist.get_rank()
    try:
        spec = {name: SplitPoint.BEGINNING for name in llama_cuts(args.llama_layers, pp)}
        pipe = pipeline(Llama(args.llama_layers), mb_args=(ids[: len(ids) // 4],), split_spec=spec)
        module = pipe.get_stage_module(rank)
        schedule = ScheduleGPipe(build_stage(module, rank, pipe.info(), torch.device("cpu")), 4, loss_fn=lm_loss)
        opt = llama_sgd(module.parameters())
        return [_torch_schedule_step(schedule, opt, rank, pp, ids, target) for _ in range(args.llama_steps)]
    except Exception as e:
        raise RuntimeError(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}") from e


def llama_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 96, (8, 8), generator=g), torch.randint(0, 96, (8, 8), generator=g)  # (B, S)


def llama_cuts(layers: int, pp: int) -> list[str]:
    return [f"lm.model.layers.{k * layers // pp}" for k in range(1, pp)]


def _launch_all(args: argparse.Namespace, pp: int) -> dict:
    """Everything that runs on ``pp`` healthy ranks, in one job."""
    return {
        "bubble": _bubble_rank(args, pp) if pp in args.pp else None,
        "versus": _versus_torch_rank(args, pp) if pp in args.compare_pp else None,
        "skip": _skip_autopar_rank(args, pp) if pp in args.skip_pp else None,
    }


# ---------------------------------------------------------------------------
# Reading the results
# ---------------------------------------------------------------------------


def lowered(schedule: str, pp: int, m: int) -> Schedule:
    return add_communication(make_schedule(schedule, pp, m, stages_per_rank(schedule)))


def theory(schedule: str, pp: int, m: int) -> float:
    v = stages_per_rank(schedule)
    return (pp - 1) / (v * m + pp - 1)


def bubble_rows(results: list[dict], pp: int, args: argparse.Namespace, p2p: float) -> list[str]:
    rows = []
    for schedule, m in runs(args, pp):
        per_step = [[r["bubble"][(schedule, m)]["timelines"][k] for r in results] for k in range(args.steps)]
        everything = [tl for step in per_step for tl in step]
        f, b = durations(everything, FORWARD), durations(everything, BACKWARD)
        sim = simulate(lowered(schedule, pp, m), forward_time=f, backward_time=b, comm_time=p2p).bubble_fraction
        fractions = [step_fractions(step, ((RECV_F, RECV_B), (SEND_F, SEND_B))) for step in per_step]
        bubble, recv, send = (statistics.median(x[i] for x in fractions) for i in range(3))
        rows.append(f"  {schedule:<17} {pp:>2} {m:>3}  {theory(schedule, pp, m):>6.1%}  {sim:>9.1%}  {bubble:>8.1%}"
                    f"  {recv:>7.1%}  {send:>7.1%}  {f * 1e3:>6.2f}  {b * 1e3:>6.2f}")
    return rows


def peak_rows(results: list[dict], pp: int, args: argparse.Namespace) -> list[str]:
    rows = []
    for schedule, m in runs(args, pp):
        peak: dict[int, int] = {}
        for r in results:
            peak |= r["bubble"][(schedule, m)]["peak"]
        got = [peak[s] for s in sorted(peak)]
        expected = list(simulate(lowered(schedule, pp, m)).peak_in_flight)
        bound = {"gpipe": f"m = {m}", "1f1b": f"min(p - s, m) = {[min(pp - s, m) for s in range(pp)]}"}
        rows.append(f"  {schedule:<17} {pp:>2} {m:>3}  {str(got):<26} {bound.get(schedule, 'simulated ' + str(expected))}"
                    f"{'' if got == expected else '   (simulator says ' + str(expected) + ')'}")
    return rows


def versus_rows(results: list[dict], pp: int, args: argparse.Namespace) -> list[str]:
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in args.microbatches:
            per_rank = [r["versus"][(schedule, m)] for r in results]
            a = statistics.median(r["autopar"] for r in per_rank)
            t = statistics.median(r["torch"] for r in per_rank)
            last = per_rank[0]["last"]
            rows.append(f"  {schedule:<6} {pp:>2} {m:>3}  {a * 1e3:>10.1f}  {t * 1e3:>8.1f}  {a / t:>13.3f}"
                        f"  {abs(last['autopar'] - last['torch']):>9.1e}")
    return rows


def skip_lines(args: argparse.Namespace, autopar_losses: dict[int, list[float]], torch_lines: dict[int, str],
               ref: list[float]) -> list[str]:
    lines = [f"4. skip connections across stages: LLaMA, {args.llama_layers} layers, d=32, float64, random weights; "
             f"RoPE cos/sin are made once and used by every layer. microbatches 4, {args.llama_steps} SGD steps; "
             f"single-device losses {', '.join(f'{x:.6f}' for x in ref)}"]
    for pp in sorted(torch_lines):
        lines.append(f"  torch.distributed.pipelining pp={pp} (pipeline + SplitPoint, GPipe): {torch_lines[pp]}")
    for pp in sorted(autopar_losses):
        lines.append(f"  autopar pp={pp} (1f1b): trains; max |loss - single device| = {max_diff(autopar_losses[pp], ref):.1e}")
    return lines


def max_diff(losses: list[float], ref: list[float]) -> float:
    return max(abs(a - r) for a, r in zip(losses, ref, strict=True))


def torch_skip_summary(args: argparse.Namespace, pp: int, ref: list[float]) -> str:
    """Runs torch's pipelining on the LLaMA at ``pp`` stages: its error, or its losses against single-device."""
    try:
        losses = autopar.launch(_skip_torch_rank, pp, args, pp)[0]
    except autopar.RankError as e:
        last = e.detail.strip().splitlines()[-1]
        return f"fails on rank {e.rank}: {last.removeprefix('RuntimeError: ')}"
    return f"trains; max |loss - single device| = {max_diff(losses, ref):.1e}"


def print_bubbles(results: dict[int, list[dict]], args: argparse.Namespace, cores: int) -> None:
    print(f"1. bubble fraction ({args.steps} steps; measured = mean over ranks of 1 - F/B time / step span, of which "
          f"'in RECV' and 'in SEND' are the shares spent in receives and sends; simulated = autopar.core.simulate with the "
          f"median F, B and p2p times)")
    print(f"  {'schedule':<17} {'pp':>2} {'m':>3}  {'theory':>6}  {'simulated':>9}  {'measured':>8}  {'in RECV':>7}"
          f"  {'in SEND':>7}  {'F ms':>6}  {'B ms':>6}")
    for pp in args.pp:
        print("\n".join(bubble_rows(results[pp], pp, args, results[pp][0]["bubble"]["p2p"])))
    for pp in args.pp:
        print(f"  p2p pp={pp}: {results[pp][0]['bubble']['p2p'] * 1e3:.3f} ms one way per activation "
              f"({args.rows * args.width * 4 // 1024} KiB)")
    for pp in (pp for pp in args.pp if pp > cores):
        print(f"  caveat: pp={pp} runs {pp} ranks on {cores} cores. A rank waiting for a core inside F or B counts as "
              f"busy, so the measured bubble is not comparable with theory there; F/B times are inflated too.")


def print_peaks(results: dict[int, list[dict]], args: argparse.Namespace) -> None:
    print("2. peak in-flight microbatches per stage (activations held between F and B), stage 0 first")
    print(f"  {'schedule':<17} {'pp':>2} {'m':>3}  {'measured per stage':<26} bound")
    for pp in args.pp:
        print("\n".join(peak_rows(results[pp], pp, args)))


def print_versus(results: dict[int, list[dict]], args: argparse.Namespace, cores: int) -> None:
    print("3. step time against torch.distributed.pipelining (PipelineStage + ScheduleGPipe/Schedule1F1B; same chain, "
          f"cuts, ranks, microbatches; {args.compare_steps} interleaved steps, median)")
    print(f"  {'sched':<6} {'pp':>2} {'m':>3}  {'autopar ms':>10}  {'torch ms':>8}  {'autopar/torch':>13}  {'loss diff':>9}")
    for pp in args.compare_pp:
        print("\n".join(versus_rows(results[pp], pp, args)))
    if any(pp > cores for pp in args.compare_pp):
        print(f"  caveat: pp > {cores} oversubscribes the cores")
    print("  target: autopar/torch <= 1.0; loss diff = |last autopar loss - last torch loss|, both after the same steps")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, nargs="*", default=[2, 4], help="pipeline ranks for the bubble and in-flight runs")
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    p.add_argument("--steps", type=int, default=8, help="measured steps per bubble run")
    p.add_argument("--compare-steps", type=int, default=12, help="measured steps per autopar/torch pair")
    add_chain_arguments(p, default="tanh")
    p.add_argument("--compare-pp", type=int, nargs="*", default=[2], help="pp values to time against torch")
    p.add_argument("--skip-pp", type=int, nargs="*", default=[2, 4], help="pp values for the LLaMA demonstration")
    p.add_argument("--llama-layers", type=int, default=4)
    p.add_argument("--llama-steps", type=int, default=3)
    args = chain_sizes(p.parse_args())

    cores = os.cpu_count() or 1
    began = time.perf_counter()
    print(header("pipeline", args) + ", then medians\n")
    jobs = sorted(set(args.pp) | set(args.compare_pp) | set(args.skip_pp))
    results = {pp: autopar.launch(_launch_all, pp, args, pp) for pp in jobs}
    ids, target = llama_batch()
    ref = reference_run(functools.partial(Llama, args.llama_layers), (ids,), target, lm_loss, llama_sgd,
                        args.llama_steps).losses
    torch_lines = {pp: torch_skip_summary(args, pp, ref) for pp in args.skip_pp}
    if args.pp:
        print_bubbles(results, args, cores)
        print()
        print_peaks(results, args)
        print()
    if args.compare_pp:
        print_versus(results, args, cores)
        print()
    if args.skip_pp:
        print("\n".join(skip_lines(args, {pp: results[pp][0]["skip"] for pp in args.skip_pp}, torch_lines, ref)))
    print(f"\ntotal {time.perf_counter() - began:.0f} s; load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
