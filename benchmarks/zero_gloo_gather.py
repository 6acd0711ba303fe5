"""ZeRO's gather on gloo: one in-place broadcast per rank (``all_gather_async``) against gloo's all-gather.

Two parts, each on 2 gloo ranks of one thread:

1. The collective alone: a new flat buffer of each size (the runtime allocates one for each gather) filled
   from every rank's slice, by gloo's ``all_gather_into_tensor`` (which receives into a temporary of the whole
   size and copies each slice out) and by ``runtime.zero_group.all_gather_async``; rounds interleaved, median
   milliseconds a call and the ratio.
2. ``--steps N``: a LLaMA under ZeRO-3 with ``compile=True`` (``--width``, 4 layers), N steps after 3 warm-up
   steps with each gather, per rank: page faults and system CPU a step (``getrusage``) and resident memory
   before and after the steps (``/proc/self/statm``). "gloo all-gather" swaps the runtime's gather for gloo's.

Run: PYTHONPATH=.:benchmarks python benchmarks/zero_gloo_gather.py [--steps 5] [--width 256]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import autopar
from autopar.runtime import zero_group


def gloo_all_gather(full: torch.Tensor, group: Any = None) -> object:
    """What the runtime ran before: gloo's own all-gather of this rank's slice into ``full``."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    k = full.numel() // n
    return zero_group.all_gather_flat(full, full[me * k : (me + 1) * k], group=group, async_op=True)


GATHERS = {"gloo all-gather": gloo_all_gather, "broadcasts": zero_group.all_gather_async}


def _collective(sizes: list[int], calls: int = 30, rounds: int = 5) -> dict[int, dict[str, float]]:
    torch.set_num_threads(1)
    r, n = dist.get_rank(), dist.get_world_size()
    out: dict[int, dict[str, float]] = {}
    for size in sizes:
        times: dict[str, list[float]] = {name: [] for name in GATHERS}
        for i in range(rounds):
            for name, gather in (GATHERS.items() if i % 2 == 0 else reversed(GATHERS.items())):
                dist.barrier()
                t = time.perf_counter()
                for _ in range(calls):  # a new buffer each call, as the runtime gathers into one
                    full = torch.empty(size)
                    full[r * size // n : (r + 1) * size // n].fill_(r)
                    gather(full).wait()
                times[name].append((time.perf_counter() - t) / calls)
        expected = torch.arange(n, dtype=full.dtype).repeat_interleave(size // n)
        assert torch.equal(full, expected), "the gather did not assemble every rank's slice"
        out[size] = {name: statistics.median(v) for name, v in times.items()}
    return out


def _resident_mb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 >> 20


def _steps(args: argparse.Namespace, gather: str) -> dict[str, float]:
    import resource

    from compiled_vs_eager import fused_optimizer, lm_loss
    from tp_vs_dtensor import make_llama

    torch.set_num_threads(1)
    zero_group.all_gather_async = GATHERS[gather]  # (this rank process's runtime only)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    pm = autopar.parallelize(make_llama(args), autopar.Mesh(dp=2), loss_fn=lm_loss, optimizer=fused_optimizer,
                             zero=3, compile=True)
    for _ in range(3):
        pm.step(ids, target=ids)
    dist.barrier()
    before, mb_before = resource.getrusage(resource.RUSAGE_SELF), _resident_mb()
    for _ in range(args.steps):
        pm.step(ids, target=ids)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"faults": (after.ru_minflt - before.ru_minflt) / args.steps,
            "system ms": (after.ru_stime - before.ru_stime) / args.steps * 1e3,
            "resident MB before": mb_before, "resident MB after": _resident_mb()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="1,2.85,11.4,22.8", help="flat buffer sizes, MB of float32")
    p.add_argument("--steps", type=int, default=0, help="also run the LLaMA under ZeRO-3 for this many steps")
    p.add_argument("--width", type=int, default=256)
    args = p.parse_args()
    args.layers, args.heads, args.kv_heads = 4, args.width // 32, args.width // 64
    args.vocab, args.batch, args.seq = 2048, 8, 128
    sizes = [int(float(mb) * 2**20 / 4) // 2 * 2 for mb in args.sizes_mb.split(",")]
    rows = autopar.launch(_collective, 2, sizes)
    print("gather of a flat float32 buffer over 2 gloo ranks, median ms a call (the slower rank's):")
    for size in sizes:
        t = {name: max(r[size][name] for r in rows) for name in GATHERS}
        print(f"  {size * 4 / 2**20:6.2f} MB: gloo all-gather {t['gloo all-gather'] * 1e3:.2f} ms, broadcasts "
              f"{t['broadcasts'] * 1e3:.2f} ms; gloo / broadcasts {t['gloo all-gather'] / t['broadcasts']:.2f}")
    if args.steps:
        print(f"LLaMA 4x{args.width} under ZeRO-3, compile=True, {args.steps} steps after 3, per rank:")
        for gather in GATHERS:
            for rank, r in enumerate(autopar.launch(_steps, 2, args, gather)):
                print(f"  {gather:>15}, rank {rank}: " + ", ".join(f"{k} {v:.0f}" for k, v in r.items()))


if __name__ == "__main__":
    main()
