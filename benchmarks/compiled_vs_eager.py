"""autopar compile=True against its eager rank graphs, and against torch.compile of torch's own parallel model.

One LLaMA (transformers: RMSNorm, SwiGLU, rotary positions; float32, AdamW) on 2 gloo ranks, for each
configuration: autopar eager (``compile=False``), autopar compiled (``compile=True``) and torch's equivalent
with ``torch.compile`` (dp2: DDP around the compiled model; tp2: DTensor's ``parallelize_module`` with the
Megatron plan of ``tp_vs_dtensor.py``, then compiled; zero3: FSDP2's ``fully_shard`` per layer and the root,
each layer compiled, as torchtitan applies it). Every variant builds the model from one seed and takes the same
global batch; after warm-up steps (compilation) their steps alternate order and each one's median step time is
kept. Ratios: compiled / eager (target <= 0.85) and compiled / torch compiled (target <= 1.0). The first step
of each variant (export, passes, inductor's compilation, the step) is reported too. Optimizers: autopar eager
steps AdamW's per-tensor loop; ``compile=True`` steps it in torch's fused kernel (docs/decisions.md), and so
does torch's compiled model (``AdamW(fused=True)``, its DTensor parameters under ``implicit_replication``,
which the fused kernel needs for its step counts), so that both compiled variants run the same update; a fourth
variant, ``compiled, loop``, is ``compile=True`` with AdamW's per-tensor loop (``foreach=False``), to tell the
fused step's share of the gain from the compiled graphs'.

``--breakdown`` profiles eager and compiled steps and splits each into matmuls, attention and the rest.

``--bucket-mb X`` (dp2) adds the three variants again with gradient buckets of X MiB (autopar's ``bucket_mb``,
DDP's ``bucket_cap_mb``; both default to 25), interleaved with the others.

Run: PYTHONPATH=.:benchmarks python benchmarks/compiled_vs_eager.py [--configs dp2,tp2,zero3] [--steps 10]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import autopar
from tp_vs_dtensor import llama_plan, make_llama, optimizer


def fused_optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def loop_optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, foreach=False)


def fused_step(opt: torch.optim.Optimizer) -> None:
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        opt.step()

CONFIGS = {"dp2": (autopar.Mesh(dp=2), {}), "tp2": (autopar.Mesh(tp=2), {}), "zero3": (autopar.Mesh(dp=2), {"zero": 3})}


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def _autopar(config: str, args: argparse.Namespace, ids: torch.Tensor, compiled: bool,
             factory: Callable[[list], Any] = optimizer, **extra: Any) -> Callable[[], float]:
    mesh, options = CONFIGS[config]
    pm = autopar.parallelize(make_llama(args), mesh, loss_fn=lm_loss, optimizer=factory, compile=compiled,
                             **options, **extra)
    return lambda: pm.step(ids, target=ids)


def _torch(config: str, args: argparse.Namespace, ids: torch.Tensor, bucket_mb: float | None = None
           ) -> Callable[[], float]:
    """torch's own parallel model of ``config``, compiled (see the module doc); ``bucket_mb``: DDP's bucket cap
    (its default when None)."""
    from torch.distributed.device_mesh import init_device_mesh

    model = make_llama(args)
    rank, n = dist.get_rank(), dist.get_world_size()
    local = ids if config == "tp2" else ids.chunk(n)[rank]
    if config == "dp2":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(torch.compile(model), **({} if bucket_mb is None else
                                                                  {"bucket_cap_mb": bucket_mb}))
    elif config == "tp2":
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (n,), mesh_dim_names=("tp",)), llama_plan(model))
        compiled_model = torch.compile(model)
        opt = fused_optimizer(list(model.parameters()))

        def tp_step() -> float:
            with loss_parallel():
                loss = lm_loss(compiled_model(local), local)
                loss.backward()
            fused_step(opt)
            opt.zero_grad(set_to_none=True)
            return float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach())

        return tp_step
    else:
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer)
            fully_shard(model.model.layers[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = fused_optimizer(list(model.parameters()))

    def step() -> float:
        loss = lm_loss(model(local), local)
        loss.backward()
        fused_step(opt)
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)  # (autopar's step returns the global loss too)
        return float(total) / n

    return step


def _rank(config: str, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    steps = {"eager": _autopar(config, args, ids, False), "compiled": _autopar(config, args, ids, True),
             "compiled, loop": _autopar(config, args, ids, True, loop_optimizer),
             "torch compiled": _torch(config, args, ids)}
    if args.bucket_mb is not None and config == "dp2":  # the same three with other gradient buckets
        mb = args.bucket_mb
        steps |= {"eager, buckets": _autopar(config, args, ids, False, bucket_mb=mb),
                  "compiled, buckets": _autopar(config, args, ids, True, bucket_mb=mb),
                  "torch compiled, buckets": _torch(config, args, ids, mb)}
    first, times, losses = {}, {name: [] for name in steps}, {name: [] for name in steps}
    for name, fn in steps.items():
        dist.barrier()
        t = time.perf_counter()
        losses[name].append(fn())
        first[name] = time.perf_counter() - t
    for i in range(args.warmup + args.steps):
        order = list(steps.items())
        for name, fn in order if i % 2 == 0 else reversed(order):
            dist.barrier()
            t = time.perf_counter()
            losses[name].append(fn())
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
    split = _breakdown({k: steps[k] for k in ("eager", "compiled")}) if args.breakdown else {}
    return {"median": {k: statistics.median(v) for k, v in times.items()}, "first": first, "losses": losses,
            "split": split}


def _breakdown(steps: dict[str, Callable[[], float]], rounds: int = 3) -> dict[str, dict[str, float]]:
    """Each variant's step split by ``torch.profiler`` (rounds interleaved): CPU seconds in ``aten::mm``, in the
    attention kernels, in every other op, and the wall time the profiled step took (the rest is Python and
    waiting), medians over the rounds."""
    from torch.profiler import ProfilerActivity, profile

    split: dict[str, dict[str, list[float]]] = {k: {} for k in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            dist.barrier()
            t = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            wall = time.perf_counter() - t
            ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
            mm = ops.get("aten::mm", 0.0) + ops.get("aten::addmm", 0.0)
            attention = sum(v for k, v in ops.items() if "scaled_dot_product" in k)
            for part, v in {"wall": wall, "mm": mm, "attention": attention,
                            "other ops": sum(ops.values()) - mm - attention}.items():
                split[name].setdefault(part, []).append(v)
    return {name: {part: statistics.median(v) for part, v in parts.items()} for name, parts in split.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="dp2,tp2,zero3")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="dp2: also run autopar and DDP with gradient buckets of this many MiB, interleaved")
    p.add_argument("--breakdown", action="store_true", help="also split eager and compiled steps by the profiler")
    args = p.parse_args()
    print(f"LLaMA {args.layers}x{args.width} (heads {args.heads}/{args.kv_heads}), vocab {args.vocab}, batch "
          f"{args.batch}x{args.seq}, float32, AdamW, 2 gloo ranks of one thread; {args.steps} interleaved steps")
    for config in args.configs.split(","):
        results = autopar.launch(_rank, 2, config, args)
        med = {k: statistics.median(r["median"][k] for r in results) for k in results[0]["median"]}
        first = {k: max(r["first"][k] for r in results) for k in results[0]["first"]}
        drift = max(abs(a - b) for a, b in zip(results[0]["losses"]["eager"], results[0]["losses"]["compiled"]))
        print(f"{config:>6}: median step eager {med['eager'] * 1e3:.1f} ms, compiled {med['compiled'] * 1e3:.1f} ms, "
              f"torch compiled {med['torch compiled'] * 1e3:.1f} ms; compiled/eager {med['compiled'] / med['eager']:.3f} "
              f"(target <= 0.85), compiled/torch compiled {med['compiled'] / med['torch compiled']:.3f} (target <= 1.0)")
        print(f"        with AdamW's per-tensor loop: compiled {med['compiled, loop'] * 1e3:.1f} ms, compiled/eager "
              f"{med['compiled, loop'] / med['eager']:.3f}")
        print(f"        first step (export, passes, compilation, the step): eager {first['eager']:.1f} s, compiled "
              f"{first['compiled']:.1f} s, torch compiled {first['torch compiled']:.1f} s; largest loss difference "
              f"compiled - eager over the steps {drift:.2e}")
        if "compiled, buckets" in med:
            print(f"        with {args.bucket_mb:g} MiB buckets (autopar's bucket_mb, DDP's bucket_cap_mb): eager "
                  f"{med['eager, buckets'] * 1e3:.1f} ms, compiled {med['compiled, buckets'] * 1e3:.1f} ms, torch "
                  f"compiled {med['torch compiled, buckets'] * 1e3:.1f} ms; compiled/eager "
                  f"{med['compiled, buckets'] / med['eager, buckets']:.3f}, compiled/torch compiled "
                  f"{med['compiled, buckets'] / med['torch compiled, buckets']:.3f}")
        for name in results[0]["split"]:
            parts = {k: statistics.median(r["split"][name][k] for r in results) for k in results[0]["split"][name]}
            print(f"        profiled {name}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in parts.items()))


if __name__ == "__main__":
    main()
