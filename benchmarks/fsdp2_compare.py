"""What the autopar-against-FSDP2 benchmarks share: model, FSDP2 setup, interleaved timing, peak bytes, report.

``zero3_vs_fsdp2.py`` (fp32) and ``bf16_vs_fsdp2.py`` (mixed precision) each build an autopar step and an
FSDP2 step (``fully_shard`` per GPT-2 block, then the root) on the same gloo ranks and global batch and hand
them to ``compare``: steps alternate which runs first, medians are kept, and peak bytes are measured, not
estimated: the persistent state (parameter shards, gradients, optimizer state) from its tensors at the start
of a step, plus the most bytes of tensors allocated during the step alive at once (a dispatch mode sees
every allocation; storages are checked when each op returns, so a buffer freed early counts as freed).
FSDP2 allocates the storages of its unsharded parameters once and afterwards resizes them in place for each
all-gather, which a dispatch mode does not see; its peak adds the bytes of those storages alive at each op
(``FSDP2Step.resized``), and the report shows it without them too (how the tables before 2026-12-02 were made).

FSDP2 gets autopar's prefetch depth ``--prefetch k`` (k >= 1) as explicit prefetch lists: each block
prefetches the next k blocks in forward and the k blocks before it in backward; the root the first k in
forward and the last k in backward (with k = 1 this is FSDP2's default order). On a CPU FSDP2's all-gathers
block unless ``--fsdp2-async`` (its ``_set_unshard_async_op(True)``): then a prefetched all-gather overlaps
compute as it does on a GPU's streams; its reduce-scatters block on a CPU either way.
"""
from __future__ import annotations

import argparse
import statistics
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autopar
from autopar.runtime.memory import optimizer_tensors, storage_bytes


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=args.vocab, n_positions=args.seq,
                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).train()


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy in float32 (bf16 logits are widened first, as torchtitan does)."""
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), target.flatten())


def optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--replicas", type=int, default=1,
                   help="hybrid sharding: R replicas of ranks/R shards (autopar Mesh(dp=(R, S)), FSDP2's 2-D mesh)")
    p.add_argument("--prefetch", type=int, default=1,
                   help="zero_prefetch: layers autopar gathers ahead; FSDP2's explicit prefetch depth too")
    p.add_argument("--recompute", default="none", choices=["none", "full"],
                   help="full: every block recomputed in backward (autopar recompute='full'; FSDP2 with torch's "
                   "composable checkpoint on each block before fully_shard, as torchtitan applies it)")
    p.add_argument("--fsdp2-async", action="store_true",
                   help="also time FSDP2 with asynchronous all-gathers (unshard_async_op), as 'fsdp2-async'")


def dp_mesh(args: argparse.Namespace) -> autopar.Mesh:
    """autopar's mesh for ``--ranks`` and ``--replicas``: plain dp, or hybrid sharding."""
    if args.ranks % args.replicas:
        raise SystemExit(f"--replicas {args.replicas} must divide --ranks {args.ranks}")
    return autopar.Mesh(dp=args.ranks if args.replicas == 1 else (args.replicas, args.ranks // args.replicas))


def batch(args: argparse.Namespace) -> torch.Tensor:
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))


class FSDP2Step:
    """FSDP2 on this rank: ``fully_shard`` per block, then the root (``mp_policy`` on each); one step per call."""

    def __init__(self, args: argparse.Namespace, ids: torch.Tensor, mp_policy: Any = None,
                 async_gathers: bool = False) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.ranks = args.ranks
        self.model = make_model(args)
        mesh = init_device_mesh("cpu", (args.ranks,), mesh_dim_names=("dp",)) if args.replicas == 1 else \
            init_device_mesh("cpu", (args.replicas, args.ranks // args.replicas), mesh_dim_names=("replicate", "shard"))
        extra = {"mp_policy": mp_policy} if mp_policy is not None else {}
        blocks = list(self.model.transformer.h)
        if getattr(args, "recompute", "none") == "full":
            from torch.distributed._composable import checkpoint

            for block in blocks:
                checkpoint(block)
        for block in blocks:
            fully_shard(block, mesh=mesh, **extra)
        fully_shard(self.model, mesh=mesh, **extra)
        prefetch_like_autopar(self.model, blocks, args.prefetch)
        if async_gathers:
            self.model._set_unshard_async_op(True)
        self.optimizer = optimizer(list(self.model.parameters()))
        self.local = ids.chunk(args.ranks)[dist.get_rank()]
        self.losses: list[float] = []

    def __call__(self) -> None:
        loss = loss_fn(self.model(self.local), self.local)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = loss.detach().float().clone()
        dist.all_reduce(total)  # autopar's step returns the global loss too
        self.losses.append(float(total) / self.ranks)

    def persistent(self) -> int:
        return persistent_bytes(list(self.model.parameters()), self.optimizer)

    def resized(self) -> int:
        """Bytes of FSDP2's unsharded parameter storages alive now (allocated by resizing, unseen by a mode)."""
        from torch.distributed.fsdp import FSDPModule

        storages = {}
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    for param in group.fsdp_params:
                        for t in param.all_gather_outputs:
                            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())


def prefetch_like_autopar(root: Any, blocks: list, k: int) -> None:
    """FSDP2's explicit prefetch lists for depth ``k``: blocks ahead in forward, behind in backward."""
    if k < 1:
        return  # (FSDP2 always prefetches one module in backward; zero_prefetch=0 has no FSDP2 equivalent)
    root.set_modules_to_forward_prefetch(blocks[:k])
    root.set_modules_to_backward_prefetch(blocks[::-1][:k])
    for i, block in enumerate(blocks):
        if blocks[i + 1 : i + 1 + k]:
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + k])
        if i > 0:
            block.set_modules_to_backward_prefetch(blocks[max(0, i - k) : i][::-1])


def fsdp2_steps(args: argparse.Namespace, ids: torch.Tensor, mp_policy: Any = None) -> dict[str, FSDP2Step]:
    """``fsdp2`` (blocking all-gathers on a CPU), and ``fsdp2-async`` with ``--fsdp2-async``."""
    steps = {"fsdp2": FSDP2Step(args, ids, mp_policy)}
    if args.fsdp2_async:
        steps["fsdp2-async"] = FSDP2Step(args, ids, mp_policy, async_gathers=True)
    return steps


class AutoparStep:
    """One ``pm.step`` on the global batch per call."""

    def __init__(self, pm: Any, ids: torch.Tensor) -> None:
        self.pm, self.ids = pm, ids
        self.losses: list[float] = []

    def __call__(self) -> None:
        self.losses.append(self.pm.step(self.ids, target=self.ids))

    def persistent(self) -> int:
        return persistent_bytes(self.pm.parameters(), self.pm.optimizer)


class PeakNewBytes(TorchDispatchMode):
    """The most bytes of storages allocated inside the mode that were alive at once (with ``resized``: plus the
    bytes it returns, counted at the same moments), and that most without them."""

    def __init__(self, resized: Callable[[], int] | None = None) -> None:
        super().__init__()
        self.live: list[weakref.ref] = []
        self.resized = resized
        self.peak = 0
        self.peak_seen = 0  # without ``resized``

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        known = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in known and t.untyped_storage().nbytes():
                self.live.append(weakref.ref(t.untyped_storage()))
        alive = [(ref, ref()) for ref in self.live]
        self.live = [ref for ref, s in alive if s is not None and s.nbytes()]
        seen = sum(s.nbytes() for ref, s in alive if s is not None)
        self.peak_seen = max(self.peak_seen, seen)
        self.peak = max(self.peak, seen + (self.resized() if self.resized is not None else 0))
        return out


def persistent_bytes(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, gradients and optimizer state that exist between steps (DTensors: local shards)."""
    def local(t: torch.Tensor | None) -> torch.Tensor | None:
        return t.to_local() if hasattr(t, "to_local") else t

    return (storage_bytes([local(p) for p in params]) + storage_bytes([local(p.grad) for p in params])
            + storage_bytes([local(t) for t in optimizer_tensors(opt)]))


def peak_bytes(step: Any) -> tuple[int, int]:
    """One step's peak bytes per rank: with the storages ``step.resized()`` reports (if it has it), and without."""
    persistent = step.persistent()
    mode = PeakNewBytes(getattr(step, "resized", None))
    with mode:
        step()
    return persistent + mode.peak, persistent + mode.peak_seen


def compare(steps: dict[str, Any], args: argparse.Namespace) -> dict:
    """Runs ``steps`` (name -> a step object) interleaved; this rank's medians, peaks and losses."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.warmup + args.steps):
        order = list(steps.items())
        for name, fn in order if i % 2 == 0 else reversed(order):
            dist.barrier()
            t = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
    peaks = {name: peak_bytes(fn) for name, fn in steps.items()}
    return {"median": {k: statistics.median(v) for k, v in times.items()}, "peak": peaks,
            "losses": {name: fn.losses for name, fn in steps.items()}}


def main(rank: Callable[[argparse.Namespace], dict], doc: str, what: str) -> None:
    """Parses the shared options, runs ``rank`` on ``--ranks`` local ranks and reports; ``what`` (formatted with
    the options) says what is compared."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args()
    report(autopar.launch(rank, args.ranks, args),
           f"GPT-2 {args.layers}x{args.width}, vocab {args.vocab}, batch {args.batch}x{args.seq}, {args.ranks} gloo "
           f"ranks ({dp_mesh(args)}), {args.steps} interleaved steps; " + what.format(**vars(args)))


def report(results: list[dict], title: str) -> None:
    """Prints autopar against FSDP2 (each FSDP2 variant timed): median step times, peak bytes per rank and
    their ratios, losses."""
    a = statistics.median(r["median"]["autopar"] for r in results)
    pa = max(r["peak"]["autopar"][0] for r in results)
    first = results[0]["losses"]
    print(title)
    for name in [k for k in results[0]["median"] if k != "autopar"]:
        f = statistics.median(r["median"][name] for r in results)
        pf = max(r["peak"][name][0] for r in results)
        seen = max(r["peak"][name][1] for r in results)
        shown = name.upper().replace("FSDP2-", "FSDP2 ")
        print(f"median step: autopar {a * 1e3:.1f} ms   {shown} {f * 1e3:.1f} ms   ratio autopar/{shown} {a / f:.3f} "
              "(target <= 1.0)")
        print(f"peak bytes per rank: autopar {pa:,} B   {shown} {pf:,} B   ratio {pa / pf:.4f} (target <= 1.0); "
              f"without {shown}'s resized unsharded parameters {seen:,} B, ratio {pa / seen:.4f}")
    if "account" in results[0]:
        print(f"autopar account after a step: {results[0]['account']}")
    n = len(first["autopar"])
    at = sorted({0, min(4, n - 1), n - 1})
    print(f"loss at step {', '.join(str(i + 1) for i in at)}: autopar "
          + ", ".join(f"{first['autopar'][i]:.5f}" for i in at)
          + "   FSDP2 " + ", ".join(f"{first['fsdp2'][i]:.5f}" for i in at))
