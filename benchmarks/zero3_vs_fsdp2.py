"""autopar zero=3 against torch's FSDP2 (``fully_shard`` per transformer block, then the root): same model,
same gloo ranks, same global batch, steps interleaved in one run.

Prints the median step time of each and the ratio autopar / FSDP2, and the peak bytes per rank of each and
their ratio (targets <= 1.0 on both). Peak bytes are measured, not estimated: the persistent state (parameter
shards, gradients, optimizer state) from its tensors at the start of a step, plus the most bytes of tensors
allocated during the step alive at once (a dispatch mode sees every allocation; storages are checked when
each op returns, so a buffer freed early counts as freed). The losses of both are printed side by side.
Run: python benchmarks/zero3_vs_fsdp2.py [--steps 20] [--layers 4] [--width 256] [--ranks 2]
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


def make_model(layers: int, width: int, vocab: int, seq: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=seq, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).train()


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


class PeakNewBytes(TorchDispatchMode):
    """The most bytes of storages allocated inside the mode that were alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live: list[weakref.ref] = []
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        known = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in known and t.untyped_storage().nbytes():
                self.live.append(weakref.ref(t.untyped_storage()))
        alive = [(ref, ref()) for ref in self.live]
        self.live = [ref for ref, s in alive if s is not None and s.nbytes()]
        self.peak = max(self.peak, sum(s.nbytes() for ref, s in alive if s is not None))
        return out


def _persistent(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, gradients and optimizer state that exist between steps (DTensors: local shards)."""
    def local(t: torch.Tensor | None) -> torch.Tensor | None:
        return t.to_local() if hasattr(t, "to_local") else t

    return (storage_bytes([local(p) for p in params]) + storage_bytes([local(p.grad) for p in params])
            + storage_bytes([local(t) for t in optimizer_tensors(opt)]))


def _peak(step: Callable[[], None], persistent: int) -> int:
    mode = PeakNewBytes()
    with mode:
        step()
    return persistent + mode.peak


def _rank(args: argparse.Namespace) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    pm = autopar.parallelize(make_model(args.layers, args.width, args.vocab, args.seq), autopar.Mesh(dp=args.ranks),
                             loss_fn=loss_fn, optimizer=optimizer, zero=3, zero_prefetch=args.prefetch)
    fsdp_model = make_model(args.layers, args.width, args.vocab, args.seq)
    mesh = init_device_mesh("cpu", (args.ranks,), mesh_dim_names=("dp",))
    for block in fsdp_model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp_model, mesh=mesh)
    fsdp_opt = optimizer(list(fsdp_model.parameters()))
    local = ids.chunk(args.ranks)[dist.get_rank()]
    losses: dict[str, list[float]] = {"autopar": [], "fsdp2": []}

    def fsdp_step() -> None:
        loss = loss_fn(fsdp_model(local), local)
        loss.backward()
        fsdp_opt.step()
        fsdp_opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)  # autopar's step returns the global loss too
        losses["fsdp2"].append(float(total) / args.ranks)

    def autopar_step() -> None:
        losses["autopar"].append(pm.step(ids, target=ids))

    times: dict[str, list[float]] = {"autopar": [], "fsdp2": []}
    for i in range(args.warmup + args.steps):
        order = [("autopar", autopar_step), ("fsdp2", fsdp_step)]
        for name, fn in order if i % 2 == 0 else reversed(order):
            dist.barrier()
            t = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
    account = pm.memory()
    peaks = {
        "autopar": _peak(autopar_step, _persistent(pm.parameters(), pm.optimizer)),
        "fsdp2": _peak(fsdp_step, _persistent(list(fsdp_model.parameters()), fsdp_opt)),
    }
    return {"median": {k: statistics.median(v) for k, v in times.items()}, "peak": peaks, "losses": losses,
            "account": account}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=1, help="zero_prefetch: layers autopar gathers ahead")
    args = p.parse_args()
    results = autopar.launch(_rank, args.ranks, args)
    a = statistics.median(r["median"]["autopar"] for r in results)
    f = statistics.median(r["median"]["fsdp2"] for r in results)
    pa = max(r["peak"]["autopar"] for r in results)
    pf = max(r["peak"]["fsdp2"] for r in results)
    first = results[0]["losses"]
    print(f"GPT-2 {args.layers}x{args.width}, vocab {args.vocab}, batch {args.batch}x{args.seq}, {args.ranks} gloo "
          f"ranks, {args.steps} interleaved steps; autopar zero=3 (prefetch {args.prefetch}) vs FSDP2 per block")
    print(f"median step: autopar {a * 1e3:.1f} ms   FSDP2 {f * 1e3:.1f} ms   ratio autopar/FSDP2 {a / f:.3f} "
          "(target <= 1.0)")
    print(f"peak bytes per rank: autopar {pa:,} B   FSDP2 {pf:,} B   ratio {pa / pf:.4f} (target <= 1.0)")
    print(f"autopar account after a step: {results[0]['account']}")
    print("loss at step 1, 5, last: autopar " + ", ".join(f"{first['autopar'][i]:.5f}" for i in (0, 4, -1))
          + "   FSDP2 " + ", ".join(f"{first['fsdp2'][i]:.5f}" for i in (0, 4, -1)))


if __name__ == "__main__":
    main()
