"""autopar tp=2 against torch's DTensor ``parallelize_module``: same model, same gloo ranks, same batch,
steps interleaved in one run.

Two models: a small Hugging Face LLaMA (random weights, float32) and a stack of residual MLP blocks.
torch's side gets the hand-written Megatron plan: q/k/v and gate/up ``ColwiseParallel``, o and down
``RowwiseParallel``; for LLaMA also the vocab-parallel embedding (``RowwiseParallel`` on ``nn.Embedding``)
and a vocab-sharded head whose logits stay a DTensor for ``loss_parallel`` (the cross-entropy then runs on
the vocab shards, as autopar's does). The installed transformers reshapes attention with ``-1`` heads, so
the plan needs no change to the model's head counts, and local outputs (``use_local_output=True``) work.
LLaMA runs against two torch plans: "DTensor", one style per linear layer, where each column-parallel
layer turns its input into a DTensor itself, so backward all-reduces the input gradient of q, k, v, gate
and up separately; and "DTensor+prep", the same plus ``PrepareModuleInput`` on attention and MLP (as
torchtitan does), so those layers share one DTensor input and backward all-reduces its gradient once.

Prints, per model: the loss of step 0 on each side (all start from rank 0's weights, so they match),
the collectives of one step on each side (count and payload bytes per rank; torch's split forward /
backward), the median step time (forward + backward + optimizer) of each, and the ratios autopar / torch
of time (target <= 1.0) and of bytes (target 1.0). Bytes are what each rank hands to the collective (the
input of an all-reduce, the local piece of an all-gather), counted at run time: autopar's from the
collective binding of the running program, torch's from a ``CommDebugMode`` that also sums input sizes.
Run: python benchmarks/tp_vs_dtensor.py [--steps 20] [--models llama,mlp] [--layers 4] [--width 256]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, loss_parallel,
                                               parallelize_module)
from torch.utils._pytree import tree_leaves

import autopar


# -- models -----------------------------------------------------------------------------------------
def make_llama(args: argparse.Namespace) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.width, intermediate_size=args.width * 8 // 3 // 16 * 16,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      vocab_size=args.vocab, max_position_embeddings=args.seq, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg).float().train()


class Block(nn.Module):
    """x + down(gelu(up(x))): the MLP half of a transformer layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))  # (B, S, D)


class Blocks(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def make_mlp(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    return Blocks(args.layers * 2, args.width).train()


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # (B, S, V)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


# -- torch's hand-written plans ---------------------------------------------------------------------
def llama_plan(model: nn.Module) -> dict[str, Any]:
    """Megatron's plan, one style per linear layer (each column-parallel layer redistributes its own input)."""
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),  # vocab-parallel embedding
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # logits sharded by vocab
    }
    for i in range(len(model.model.layers)):
        pre = f"model.layers.{i}."
        plan |= {pre + f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
        plan |= {pre + "self_attn.o_proj": RowwiseParallel(),
                 pre + "mlp.gate_proj": ColwiseParallel(), pre + "mlp.up_proj": ColwiseParallel(),
                 pre + "mlp.down_proj": RowwiseParallel()}
    return plan


def llama_plan_shared_inputs(model: nn.Module) -> dict[str, Any]:
    """The same plan, plus ``PrepareModuleInput`` on attention and MLP (as torchtitan does): q/k/v and gate/up
    consume one DTensor input, so backward sums their input gradients before a single all-reduce."""
    plan = llama_plan(model)
    for i in range(len(model.model.layers)):
        pre = f"model.layers.{i}."
        plan[pre + "self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                                     desired_input_kwarg_layouts={"hidden_states": Replicate()})
        plan[pre + "mlp"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
    return plan


def mlp_plan(model: nn.Module) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    for i in range(len(model.blocks)):
        plan |= {f"blocks.{i}.up": ColwiseParallel(), f"blocks.{i}.down": RowwiseParallel()}
    return plan


# -- counting torch's collectives -------------------------------------------------------------------
class CommBytes(CommDebugMode):
    """``CommDebugMode`` that also sums the payload bytes of each collective, by forward / backward."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()  # (direction, op) -> calls
        self.bytes: Counter = Counter()  # (direction, op) -> bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        before = sum(self.comm_counts.values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and sum(self.comm_counts.values()) > before:  # a collective ran
            key = ("backward" if self.advanced_module_tracker.is_bw else "forward", func._overloadpacket.__name__)
            payload = args[0] if args else ()
            self.calls[key] += 1
            self.bytes[key] += sum(t.numel() * t.element_size() for t in tree_leaves(payload)
                                   if isinstance(t, torch.Tensor))
        return out


@dataclass
class Comm:
    """The collectives of one step on one rank."""

    calls: dict  # op or (direction, op) -> calls
    bytes: int  # payload bytes handed to collectives
    planned: dict = field(default_factory=dict)  # autopar: (direction, op) -> calls, as its plan lists them


# -- one rank ---------------------------------------------------------------------------------------
MODELS: dict[str, tuple[Callable, Callable, dict[str, Callable]]] = {  # make, loss, torch plans by name
    "llama": (make_llama, lm_loss, {"DTensor": llama_plan, "DTensor+prep": llama_plan_shared_inputs}),
    "mlp": (make_mlp, mse_loss, {"DTensor": mlp_plan}),
}


def _batch(name: str, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if name == "llama":
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        return ids, ids
    x = torch.randn(args.batch, args.seq, args.width, generator=g)
    return x, torch.randn(x.shape, generator=g)


def _dtensor_step(make: Callable, loss_fn: Callable, plan: Callable, args: argparse.Namespace,
                  x: torch.Tensor, target: torch.Tensor) -> Callable[[], float]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = make(args)
    parallelize_module(model, mesh, plan(model))  # shards rank 0's weights, as autopar broadcasts them
    opt = optimizer(list(model.parameters()))

    def step() -> float:
        with loss_parallel():  # cross-entropy on vocab-sharded logits; a no-op for the MLP's mse
            loss = loss_fn(model(x), target)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach())

    return step


def _compare(name: str, args: argparse.Namespace) -> dict:
    make, loss_fn, plans = MODELS[name]
    x, target = _batch(name, args)
    pm = autopar.parallelize(make(args), autopar.Mesh(tp=2), loss_fn=loss_fn, optimizer=optimizer)
    steps: dict[str, Callable[[], float]] = {"autopar": lambda: pm.step(x, target=target)}
    steps |= {side: _dtensor_step(make, loss_fn, plan, args, x, target) for side, plan in plans.items()}

    loss0 = {"autopar": steps["autopar"]()}  # compiles, then one step; the binding holds that step's collectives
    comm = {"autopar": _autopar_collectives(pm)}
    for side in plans:
        with CommBytes() as counter:
            loss0[side] = steps[side]()
        comm[side] = Comm(dict(counter.calls), sum(counter.bytes.values()))

    times: dict[str, list[float]] = {side: [] for side in steps}
    sides = list(steps)
    for i in range(args.warmup + args.steps):
        order = sides[i % len(sides):] + sides[:i % len(sides)]  # each side takes each position in turn
        for side in order:
            dist.barrier()
            t = time.perf_counter()
            steps[side]()
            if i >= args.warmup:
                times[side].append(time.perf_counter() - t)
    return {"loss0": loss0, "comm": comm, "median": {k: statistics.median(v) for k, v in times.items()}}


def _autopar_collectives(pm: autopar.ParallelModel) -> Comm:
    """The step just run, as the collective binding counted it, and as the plan lists it."""
    calls = {key.split("@")[0]: n for key, n in pm.communication(calls=True).items()}  # "op@axis" -> calls
    return Comm(calls=calls, bytes=sum(pm.communication().values()),
                planned={(c.direction, c.op): c.count for c in pm.plan.collectives})


def _rank(names: list[str], args: argparse.Namespace) -> dict:
    warnings.filterwarnings("ignore", message=".*backward hook.*")  # CommDebugMode's module hooks on HF outputs
    return {name: _compare(name, args) for name in names}


# -- report -----------------------------------------------------------------------------------------
def _describe(name: str, args: argparse.Namespace) -> str:
    if name == "llama":
        return (f"LLaMA {args.layers} layers x {args.width}, {args.heads} heads ({args.kv_heads} kv), "
                f"vocab {args.vocab}, batch {args.batch}x{args.seq}")
    return f"MLP {args.layers * 2} residual blocks x {args.width} (4x up), batch {args.batch}x{args.seq}"


def _fmt_calls(calls: dict) -> str:
    return ", ".join(f"{' '.join(k) if isinstance(k, tuple) else k} x{n}" for k, n in sorted(calls.items())) or "none"


def _report(name: str, args: argparse.Namespace, results: list[dict]) -> None:
    r0 = results[0][name]
    sides = list(r0["median"])
    median = {side: statistics.median(r[name]["median"][side] for r in results) for side in sides}
    comm: dict[str, Comm] = r0["comm"]
    print(f"{_describe(name, args)}; tp=2 on 2 gloo ranks, {args.steps} interleaved steps")
    print("  loss at step 0: " + "   ".join(f"{side} {r0['loss0'][side]:.6f}" for side in sides))
    print("  collectives in one step, per rank:")
    for side in sides:
        c = comm[side]
        print(f"    {side:<13}{sum(c.calls.values())} calls, {c.bytes / 2**20:.2f} MiB ({_fmt_calls(c.calls)})")
        if c.planned and sum(c.planned.values()) != sum(c.calls.values()):
            print(f"    {'':<13}(the plan lists {sum(c.planned.values())}: {_fmt_calls(c.planned)})")
    print("  median step: " + "   ".join(f"{side} {median[side] * 1e3:.1f} ms" for side in sides))
    for side in sides[1:]:
        print(f"  autopar/{side}: time {median['autopar'] / median[side]:.3f} (target <= 1.0), "
              f"bytes {comm['autopar'].bytes / max(comm[side].bytes, 1):.3f} (target 1.0)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama,mlp", help="comma-separated: llama, mlp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=4, help="LLaMA layers (the MLP stack has twice as many blocks)")
    p.add_argument("--width", type=int, default=256, help="hidden size of both models")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = set(names) - set(MODELS)
    if unknown:
        p.error(f"unknown model(s) {sorted(unknown)}; choose from {sorted(MODELS)}")
    results = autopar.launch(_rank, 2, names, args)
    for name in names:
        _report(name, args, results)


if __name__ == "__main__":
    main()
