"""The CUDA path end to end on one GPU: every feature in bf16 with recomputation, against one device.

Phase 1, one rank: NCCL with world size 1 on the GPU (on a machine without CUDA, gloo on the CPU; the
script says so). Phase 2, 2 and 4 ranks sharing the one device over gloo (CUDA tensors: gloo stages them
through host memory): dp=2, tp=2 (also with sequence parallelism), pp=2 under 1F1B and under the
zero-bubble ZB-H1, dp=2 with ZeRO-3 and full recomputation, two 2x2 meshes, and two with ``precision="mixed"``
(bf16 parameters and gradients, float32 masters in the optimizer), and three with ``compile=True`` (each rank's
graphs through inductor), timed against their eager twins. Each configuration trains a small GPT-2 or LLaMA (Hugging Face
configurations, random weights) for ``--steps`` steps with ``precision="bf16"`` and ``recompute="selective"``
(or "full"), then compares the losses, the forward output and the update of the parameters with
``autopar.testing.MixedPrecisionReference`` (the same policy as an eager loop on the same device) within
``autopar.testing.MixedBounds``. One 2x2 mesh runs in float64 and must match single-device training to a
relative 1e-12 (the bound of ``tests/test_exactness.py``). Then ``--timed`` more steps are timed.

Prints a table (configuration, ranks, backend, device, worst error against its bound, PASS/FAIL, median
step time, peak CUDA memory of rank 0) and exits 1 if any configuration fails.
Run: python benchmarks/gpu_check.py [--device cuda|cpu] [--steps 3] [--timed 5] [--ranks 4]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import autopar
from autopar.runtime.launch import WorkerPool
from autopar.testing import MIXED, Run, mixed_errors, reference_run, relative_errors

EXACT = 1e-12  # float64: relative error of losses, output and updates against one device
VOCAB, SEQ, BATCH = 128, 16, 8


@dataclass(frozen=True)
class Config:
    """One check: a model on a mesh with parallelize's options."""

    name: str
    model: str  # "gpt2" or "llama"
    mesh: dict[str, int]
    options: dict[str, Any] = field(default_factory=dict)
    exact: bool = False  # float64 and fp32 precision, compared at EXACT; else float32 masters in bf16
    precision: str = "bf16"  # or "mixed": bf16 parameters and gradients, float32 masters in the optimizer

    @property
    def ranks(self) -> int:
        return autopar.Mesh(**self.mesh).size

    def parallelize_options(self) -> dict[str, Any]:
        mixed = {} if self.exact else {"precision": self.precision}
        return {"recompute": "selective", **mixed, **self.options}


CONFIGS = [
    Config("1 rank", "gpt2", dict(dp=1)),
    Config("dp=2", "gpt2", dict(dp=2)),
    Config("tp=2", "llama", dict(tp=2)),
    Config("tp=2 sequence parallel", "gpt2", dict(tp=2), dict(sequence_parallel=True)),
    Config("pp=2 1f1b", "gpt2", dict(pp=2), dict(schedule="1f1b", microbatches=2)),
    Config("pp=2 zb-h1", "llama", dict(pp=2), dict(schedule="zb-h1", microbatches=2)),
    Config("dp=2 zero=3 recompute=full", "llama", dict(dp=2), dict(zero=3, recompute="full")),
    Config("dp=2 x tp=2 zero=3", "gpt2", dict(dp=2, tp=2), dict(zero=3)),
    Config("dp=2 zero=1 mixed", "gpt2", dict(dp=2), dict(zero=1), precision="mixed"),
    Config("dp=2 x pp=2 zero=3 mixed", "llama", dict(dp=2, pp=2), dict(zero=3, microbatches=2), precision="mixed"),
    Config("pp=2 x tp=2 float64", "llama", dict(pp=2, tp=2), dict(microbatches=2), exact=True),
    Config("1 rank compiled", "gpt2", dict(dp=1), dict(compile=True)),  # compile=True beside its eager twin
    Config("tp=2 compiled", "llama", dict(tp=2), dict(compile=True)),
    Config("dp=2 zero=3 recompute=full compiled", "llama", dict(dp=2), dict(zero=3, recompute="full", compile=True)),
]
COMPILED = " compiled"  # a configuration named so is timed against the one named without it (target >= 1.15x)


def gpt2(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).to(dtype).train()


def llama(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg).to(dtype).train()


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def model_factory(config: Config) -> Callable[[], torch.nn.Module]:
    build = {"gpt2": gpt2, "llama": llama}[config.model]
    dtype = torch.float64 if config.exact else torch.float32
    return lambda: build(dtype)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _cpu(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x, tree)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(config: Config, steps: int, timed: int) -> dict[str, Any]:
    """Trains ``steps`` steps (compared) and ``timed`` more (timed) on this rank."""
    ids, target = batch()
    pm = autopar.parallelize(model_factory(config)(), autopar.Mesh(**config.mesh), loss_fn=loss_fn, optimizer=sgd,
                             **config.parallelize_options())
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(pm.step(ids, target=target))  # (the loss is read: the step has finished)
        times.append(time.perf_counter() - t0)
    run = Run(losses, _cpu(pm(ids)), pm.state_dict())
    device = pm.runtime.groups.device
    times = times[1:] or times  # without timed steps: the compared ones after the first (which compiles)
    if timed:
        times = []
        for _ in range(timed):
            _synchronize(device)
            t0 = time.perf_counter()
            pm.step(ids, target=target)
            _synchronize(device)
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"run": run, "step_s": step_s, "device": str(device), "backend": dist.get_backend(), "peak": peak}


def check(config: Config, pool: WorkerPool, reference: Run, steps: int, timed: int) -> dict[str, Any]:
    """Runs ``config`` on ``pool``; its worst error against the bound, over every rank."""
    try:
        results = pool.launch(_rank, config.ranks, config, steps, timed)
    except Exception as e:  # noqa: BLE001 - a failing configuration is reported in the table, the others still run
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}", "detail": str(e)}
    worst = (0.0, "")
    for r in results:
        if config.exact:
            error, what = relative_errors(reference, r["run"])
            worst = max(worst, (error / EXACT, f"{error:.1e} / {EXACT:.0e} ({what})"))
        else:
            for metric, error in mixed_errors(reference, r["run"]).items():
                bound = getattr(MIXED, metric)
                worst = max(worst, (error / bound, f"{metric} {error:.1e} / {bound:.0e}"))
    first = results[0]
    return {"ok": worst[0] <= 1.0, "error": worst[1], "step_s": first["step_s"], "device": first["device"],
            "backend": first["backend"], "peak": first["peak"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=3, help="training steps compared with one device")
    p.add_argument("--timed", type=int, default=5, help="further steps whose median time is printed")
    p.add_argument("--ranks", type=int, default=4, choices=[1, 2, 4], help="skip configurations of more ranks")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here; use --device cpu for the smoke run")
    describe = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"gpu_check: torch {torch.__version__}, {describe}; {args.steps} steps compared, {args.timed} timed")
    if not cuda:
        print("  phase 1 (NCCL, world size 1) skipped: no CUDA device here; that rank runs over gloo on the CPU")
    configs = [c for c in CONFIGS if c.ranks <= args.ranks]
    ids, target = batch()
    rows = []
    with WorkerPool(1, backend="nccl" if cuda else "gloo", device=args.device) as single, \
            WorkerPool(max(c.ranks for c in configs), backend="gloo", device=args.device) as shared:
        for config in configs:
            t0 = time.perf_counter()
            reference = reference_run(model_factory(config), (ids,), target, loss_fn, sgd, args.steps,
                                      precision="fp32" if config.exact else config.precision, device=args.device)
            out = check(config, single if config.ranks == 1 else shared, reference, args.steps, args.timed)
            rows.append((config, out))
            print(f"  {config.name}: {'PASS' if out['ok'] else 'FAIL'} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print_table(rows)
    print_speedups(rows)
    failed = [(c, out) for c, out in rows if not out["ok"]]
    for config, out in failed:
        print(f"\n{config.name} failed:\n{out.get('detail', out['error'])}")
    return 1 if failed else 0


def print_speedups(rows: list[tuple[Config, dict[str, Any]]]) -> None:
    """compile=True against eager: each compiled configuration's median step beside its twin's."""
    times = {config.name: out["step_s"] for config, out in rows if "step_s" in out}
    for name, compiled in times.items():
        eager = times.get(name.removesuffix(COMPILED)) if name.endswith(COMPILED) else None
        if eager is not None:
            print(f"compile=True, {name.removesuffix(COMPILED)}: eager {eager * 1e3:.1f} ms / compiled "
                  f"{compiled * 1e3:.1f} ms = {eager / compiled:.2f}x (target >= 1.15x on a GPU)")


def print_table(rows: list[tuple[Config, dict[str, Any]]]) -> None:
    header = f"{'configuration':28} {'ranks':>5} {'backend':8} {'device':7} {'result':6} {'step ms':>8} " \
             f"{'peak MiB':>8}  worst error / bound"
    print("\n" + header + "\n" + "-" * len(header))
    for config, out in rows:
        step = f"{out['step_s'] * 1e3:.1f}" if "step_s" in out else "-"
        peak = f"{out['peak'] / 2**20:.0f}" if out.get("peak") is not None else "-"
        print(f"{config.name:28} {config.ranks:>5} {out.get('backend', '-'):8} {out.get('device', '-'):7} "
              f"{'PASS' if out['ok'] else 'FAIL':6} {step:>8} {peak:>8}  {out['error']}")


if __name__ == "__main__":
    sys.exit(main())
