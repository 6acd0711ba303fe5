"""Compile time: ``torch.export`` (the capture) against autopar's tensor-parallel passes, on meta models.

Models are built on the meta device (no weights are allocated, so 7B-shaped models fit anywhere) and
captured with their loss on a meta batch of ids (1, 128). Two timings per model:
  export  ``autopar.compiler.capture.capture(model, (ids,), {}, with_loss=True, ...)``: torch.export, non-strict,
          plus autopar's small bookkeeping on the exported program;
  passes  ``passes.tensor_parallel.tensor_parallel(cap, tp, trainable)``: everything tensor parallelism
          does at compile time; the sharding solver (candidate strategies, repeated-block detection, the
          ILP) and the lowering to the tp-rank graph are also shown on their own.
Times are CPU seconds of this process (``time.process_time``), which other work on a shared machine does
not inflate; wall-clock seconds are printed beside them.
Prints a LLaMA-7B-shaped model (32 layers, hidden 4096, intermediate 11008, 32 heads, vocab 32000) and
GPT-2-shaped models of growing depth (hidden 1024, 16 heads, vocab 50257) side by side, the ratio
passes / export (target <= 1.0), and how the pass time grows with the layer count (1.0 = linear).
One untimed warm-up capture per model family pays torch's one-time costs first.
Run: python benchmarks/compile_time.py [--tp 8] [--llama-layers 32] [--gpt2-layers 12,24,48,96] [--repeat 3]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from autopar.compiler.capture import capture
import autopar.passes.tensor_parallel as tp_pass


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # (B, S, V)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def llama(layers: int, args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048, use_cache=False)
    return LlamaForCausalLM(cfg).train()


def gpt2(layers: int, args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=args.gpt2_width, n_head=args.gpt2_width // 64, vocab_size=50257,
                     n_positions=1024, use_cache=False)
    return GPT2LMHeadModel(cfg).train()


@dataclass
class Timing:
    family: str
    layers: int
    nodes: int = 0
    export_s: float = math.nan
    passes_s: float = math.nan
    solve_s: float = math.nan
    lower_s: float = math.nan
    export_wall_s: float = math.nan
    passes_wall_s: float = math.nan
    error: str = ""


@contextlib.contextmanager
def timed(module: Any, names: list[str], into: Counter) -> Iterator[None]:
    """Adds the CPU seconds spent in ``module.<name>`` to ``into[name]`` while the block runs."""
    originals = {name: getattr(module, name) for name in names}

    def wrap(name: str, fn: Callable) -> Callable:
        def run(*a: Any, **k: Any) -> Any:
            t = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                into[name] += time.process_time() - t
        return run

    for name, fn in originals.items():
        setattr(module, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


def measure(family: str, make: Callable, layers: int, args: argparse.Namespace) -> Timing:
    """Median over ``args.repeat`` captures and pass runs of one meta model."""
    out = Timing(family, layers)
    runs: list[tuple[float, ...]] = []
    try:
        with torch.device("meta"):
            model = make(layers, args)
            ids = torch.randint(0, 32000, (1, args.seq))  # (B, S)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        for _ in range(args.repeat):
            gc.collect()  # the previous graphs' garbage is not charged to this capture
            wall, cpu = time.perf_counter(), time.process_time()
            cap = capture(model, (ids,), {}, with_loss=True, loss_fn=lm_loss, target=ids)
            export = time.process_time() - cpu, time.perf_counter() - wall
            out.nodes = len(cap.gm.graph.nodes)  # before the passes, which may rewrite cap.gm in place
            parts: Counter = Counter()
            gc.collect()
            with timed(tp_pass, ["solve_sharding", "lower_tp"], parts):
                wall, cpu = time.perf_counter(), time.process_time()
                lowered = tp_pass.tensor_parallel(cap, args.tp, trainable)
                passes = time.process_time() - cpu, time.perf_counter() - wall
            runs.append((export[0], passes[0], parts["solve_sharding"], parts["lower_tp"], export[1], passes[1]))
            del cap, lowered  # freed here, outside the timed regions
    except Exception as e:  # noqa: BLE001 - a model that fails is reported, the others still run
        cause = e.__cause__ or e
        out.error = f"{type(e).__name__}: {e}" + (f" (caused by {type(cause).__name__}: {cause})" if cause is not e else "")
        return out
    (out.export_s, out.passes_s, out.solve_s, out.lower_s, out.export_wall_s,
     out.passes_wall_s) = (statistics.median(r[i] for r in runs) for i in range(6))
    return out


def warm_up(make: Callable, args: argparse.Namespace) -> float:
    t = time.perf_counter()
    measure("warm-up", make, 1, argparse.Namespace(**{**vars(args), "repeat": 1}))
    return time.perf_counter() - t


def report(rows: list[Timing], args: argparse.Namespace) -> None:
    print(f"tp={args.tp}, batch (1, {args.seq}) on meta, median of {args.repeat}; CPU seconds (wall beside)")
    head = f"{'model':<20}{'layers':>7}{'nodes':>7}{'export':>9}{'passes':>9}{'(solve':>9}{'lower)':>9}" \
           f"{'passes/export':>15}{'passes/layer':>14}{'wall: export':>14}{'passes':>8}"
    print(head)
    for r in rows:
        if r.error:
            print(f"{r.family:<20}{r.layers:>7}  FAILED: {r.error}")
            continue
        print(f"{r.family:<20}{r.layers:>7}{r.nodes:>7}{r.export_s:>9.2f}{r.passes_s:>9.2f}{r.solve_s:>9.2f}"
              f"{r.lower_s:>9.2f}{r.passes_s / r.export_s:>15.2f}{r.passes_s / r.layers * 1e3:>11.1f} ms"
              f"{r.export_wall_s:>14.2f}{r.passes_wall_s:>8.2f}")
    for family in dict.fromkeys(r.family for r in rows):
        ok = [r for r in rows if r.family == family and not r.error]
        if len(ok) < 2:
            continue
        lo, hi = ok[0], ok[-1]
        growth = math.log(hi.passes_s / lo.passes_s) / math.log(hi.layers / lo.layers)
        export_growth = math.log(hi.export_s / lo.export_s) / math.log(hi.layers / lo.layers)
        print(f"{family}: {lo.layers} -> {hi.layers} layers (x{hi.layers / lo.layers:g}): passes x"
              f"{hi.passes_s / lo.passes_s:.2f} (exponent {growth:.2f}; 1.0 = linear), "
              f"export x{hi.export_s / lo.export_s:.2f} (exponent {export_growth:.2f})")
        steps = [f"{a.layers}->{b.layers}: {math.log(b.passes_s / a.passes_s) / math.log(b.layers / a.layers):.2f}"
                 for a, b in zip(ok, ok[1:])]
        print(f"{family}: passes exponent between neighbouring depths: " + ", ".join(steps))


def _layers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--llama-layers", type=_layers, default=[32], help="comma-separated; empty to skip")
    p.add_argument("--gpt2-layers", type=_layers, default=[12, 24, 48, 96], help="comma-separated; empty to skip")
    p.add_argument("--gpt2-width", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3, help="captures and pass runs per model (the median is printed)")
    args = p.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows: list[Timing] = []
    for family, make, depths in [("LLaMA-7B shape", llama, args.llama_layers),
                                 (f"GPT-2 {args.gpt2_width} shape", gpt2, args.gpt2_layers)]:
        if not depths:
            continue
        print(f"{family}: untimed warm-up (1 layer) {warm_up(make, args):.1f} s")
        rows += [measure(family, make, layers, args) for layers in depths]
    report(rows, args)


if __name__ == "__main__":
    main()
