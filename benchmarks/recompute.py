"""Activation recomputation: bytes kept per microbatch against the planner, step-time overhead, and autopar's
full recomputation against ``torch.utils.checkpoint`` on the same layers of the eager model.

1. Activation bytes per microbatch (GPT-2 and LLaMA, float32): what one microbatch's forward leaves alive for
   its backward with ``recompute="none" | "selective" | "full"``, measured from the live storages it allocated
   (``runtime.memory.NewStorages``), against the planner's prediction (``planner.recompute_cost.kept`` over the
   model's profile).
2. Step time on one rank, GPT-2 (AdamW): autopar with each mode, and the eager Hugging Face model without and
   with ``gradient_checkpointing_enable`` (``torch.utils.checkpoint``, non-reentrant) around every block —
   the layers ``recompute=`` is asked to recompute — and around every block but the last. Steps interleaved
   round-robin (the order rotating every round); each configuration's median CPU time (the process's, which
   other jobs on a shared machine do not inflate; the wall time is printed too), and the median over rounds
   of each round's ratio; ratios selective / none and full / none (target selective <= 1.10), and autopar
   full / eager checkpoint of every block (target <= 1.0), with each one's peak bytes of one step (state that
   exists between steps plus the most bytes allocated during the step alive at once; target autopar <=
   eager). What autopar recomputes is printed from its plan: with one microbatch the last layer's backward
   runs right after its forward, and autopar keeps that layer's activations where the step's simulated peak
   does not rise; autopar full / eager checkpoint of every block but the last compares the two on the layers
   each actually recomputes. The glibc allocator of the process running the steps keeps freed memory
   (``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_`` at 1 GiB unless set): otherwise which
   configuration pays page faults for memory returned to the system and mapped again depends on where the
   others' tensors happen to lie in the shared heap (up to 27 ms of system time a step, either side).

Run: PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/recompute.py [--rounds 15] [--layers 4] [--width 512]
     [--seq 128] [--batch 4]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any, Callable

import torch

import autopar
from autopar.planner import recompute_cost
from autopar.planner.cluster import Cluster
from autopar.planner.cost_model import CostModel, precision_of
from autopar.planner.model_profile import profile_model
from autopar.runtime.memory import NewStorages, optimizer_tensors, storage_bytes

MODES = ("none", "selective", "full")


def gpt2(layers: int, width: int, seq: int, vocab: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=vocab, n_positions=seq,
                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).train()


def llama(layers: int, width: int, seq: int, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(2, width // 64)
    cfg = LlamaConfig(hidden_size=width, intermediate_size=int(2.75 * width), num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, vocab_size=vocab,
                      max_position_embeddings=seq, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg).train()


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


# -- 1. activation bytes -------------------------------------------------------------------------------
def activation_bytes(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, tuple[int, float]]:
    """``mode -> (measured, predicted)`` bytes one microbatch keeps for its backward."""
    from autopar.passes.recompute import recompute

    program = autopar.parallelize(model, autopar.Mesh(dp=1), example_inputs=(ids,), example_target=ids,
                                  loss_fn=loss_fn).compile((ids,), {}, ids)
    profile = profile_model(model, example_inputs=(ids[:2, :16],), tp_sizes=(1,))
    cost = CostModel(profile, Cluster.preset("cpu"), precision_of(torch.float32), seq_len=ids.shape[1])
    units = [cost.values(seg, 1, ids.shape[0]) for seg in profile.sequence()]
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    out = {}
    for mode in MODES:
        gm = recompute(program.graph(0), lambda layer: mode).gm
        gc.collect()
        with NewStorages(track_peak=False) as new:
            loss = program.captured.run(state, [ids, ids], gm)
            gc.collect()
            measured = new.live()
        loss.backward()
        model.zero_grad(set_to_none=True)
        out[mode] = (measured, float(recompute_cost.kept(mode, units)))
    return out


# -- 2. step time -----------------------------------------------------------------------------------------
def _peak(step: Callable[[], None], params: list[torch.Tensor], opt: Any) -> int:
    """State bytes that exist between steps plus the most bytes one step allocates alive at once."""
    gc.collect()
    persistent = storage_bytes(params) + storage_bytes(optimizer_tensors(opt))
    with NewStorages() as new:
        step()
    return persistent + new.peak


def _eager(model: torch.nn.Module, ids: torch.Tensor, checkpointed: bool,
           but_last: bool = False) -> tuple[Callable[[], None], Callable[[], int]]:
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.transformer.h[-1].gradient_checkpointing = not but_last
    opt = optimizer(list(model.parameters()))

    def step() -> None:
        loss_fn(model(ids), ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda: _peak(step, list(model.parameters()), opt)


def _autopar(model: torch.nn.Module, ids: torch.Tensor, mode: str,
             plans: dict[str, str]) -> tuple[Callable[[], None], Callable[[], int]]:
    pm = autopar.parallelize(model, autopar.Mesh(dp=1), loss_fn=loss_fn, optimizer=optimizer, recompute=mode)

    def step() -> None:
        pm.step(ids, target=ids)

    step()  # compile and start the runtime
    if pm.plan.recompute is not None:
        plans[mode] = "; ".join(pm.plan.recompute.render())
    return step, lambda: _peak(step, pm.parameters(), pm.optimizer)


def step_times(args: argparse.Namespace) -> dict[str, Any]:
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    build = lambda: gpt2(args.layers, args.width, args.seq, args.vocab)  # noqa: E731
    plans: dict[str, str] = {}
    runs = {f"autopar {mode}": _autopar(build(), ids, mode, plans) for mode in MODES}
    runs["eager"] = _eager(build(), ids, checkpointed=False)
    runs["eager checkpoint"] = _eager(build(), ids, checkpointed=True)
    runs["eager ckpt but last"] = _eager(build(), ids, checkpointed=True, but_last=True)
    names = list(runs)
    for name in names:  # warm up: the optimizer state exists after the first step
        runs[name][0]()
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start, start_cpu = time.perf_counter(), time.process_time()
            runs[name][0]()
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
    peaks = {name: runs[name][1]() for name in names}
    pairs = {(a, b): statistics.median(x / y for x, y in zip(cpu[a], cpu[b]))
             for a, b in (("autopar selective", "autopar none"), ("autopar full", "autopar none"),
                          ("autopar full", "eager checkpoint"), ("autopar full", "eager ckpt but last"),
                          ("autopar none", "eager"))}
    return {"median": {k: statistics.median(v) for k, v in cpu.items()},
            "wall": {k: statistics.median(v) for k, v in wall.items()}, "peak": peaks, "paired": pairs,
            "plans": plans}


def _rank(args: argparse.Namespace) -> dict[str, Any]:
    return step_times(args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--skip-memory", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not args.skip_memory:
        print(f"1. activation bytes per microbatch (float32, batch {args.batch} x {args.seq} tokens, {args.layers} "
              f"layers of width {args.width}): measured / planner")
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        for name, build in (("GPT-2", gpt2), ("LLaMA", llama)):
            got = activation_bytes(build(args.layers, args.width, args.seq, args.vocab), ids)
            row = "   ".join(f"{mode} {m / 2**20:.2f} / {q / 2**20:.2f} MiB ({m / q - 1:+.1%})"
                           for mode, (m, q) in got.items())
            print(f"  {name:<6} {row}")
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):  # read by the rank process's allocator
        os.environ.setdefault(name, str(2**30))
    res = autopar.launch(_rank, 1, args)[0]
    med, wall, peak = res["median"], res["wall"], res["peak"]
    print(f"2. step time, GPT-2 {args.layers} x {args.width}, batch {args.batch} x {args.seq}, one rank, one thread, "
          f"{args.rounds} interleaved rounds (median CPU time, then wall time; peak bytes of one step)")
    for name in med:
        print(f"  {name:<18} {med[name] * 1e3:9.1f} ms  (wall {wall[name] * 1e3:9.1f} ms)   "
              f"peak {peak[name] / 2**20:8.1f} MiB")
    paired = res["paired"]

    def ratio(a: str, b: str) -> str:
        return f"{med[a] / med[b]:.3f} (paired {paired[(a, b)]:.3f})"

    for mode, plan in res["plans"].items():
        print(f"  autopar {mode} recomputes: {plan}")
    print("  ratios of medians (and the median of each round's ratio, which a drifting machine load cancels from):")
    print(f"  selective / none {ratio('autopar selective', 'autopar none')} (target <= 1.10)   "
          f"full / none {ratio('autopar full', 'autopar none')}")
    print(f"  autopar full / eager checkpoint of every block: step {ratio('autopar full', 'eager checkpoint')} "
          f"(target <= 1.0), peak {peak['autopar full'] / peak['eager checkpoint']:.3f} (target <= 1.0)")
    print(f"  autopar full / eager checkpoint of every block but the last: step "
          f"{ratio('autopar full', 'eager ckpt but last')}, "
          f"peak {peak['autopar full'] / peak['eager ckpt but last']:.3f}")
    print(f"  autopar none / eager: step {ratio('autopar none', 'eager')}, "
          f"peak {peak['autopar none'] / peak['eager']:.3f}")


if __name__ == "__main__":
    main()
