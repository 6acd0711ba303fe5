"""Train a LLaMA-style language model on real text with autopar, as a training script at scale feeds a job.

The corpus is the Python standard library's own source files (on every machine, nothing downloaded), read as
bytes (a byte-level tokenizer: 256 tokens). Each data-parallel rank reads its own shard through a
``DistributedSampler`` (``batch="local"``); the script logs the loss, tokens/s and an MFU estimate to the
console and to ``OUT/metrics.csv``, saves a sharded checkpoint every ``--ckpt-every`` steps, resumes from the
latest complete one with ``--resume`` (starting afresh where none was committed yet), and draws
``OUT/loss.png``. An axis given as ``*`` takes the rest of the world size, so that an elastic job that comes
back on fewer ranks re-plans its mesh (docs/user_guide.md, "Elastic training").

    python examples/train_lm.py --mesh dp=2,tp=2 --steps 200 --out runs/lm        # local CPU ranks
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh dp=2,tp=2 --out runs/lm  # or under torchrun
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --max-restarts 3 --nproc-per-node 2 \
        --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id lm \
        examples/train_lm.py --mesh 'dp=*,tp=2' --resume --out runs/lm            # elastic: restarts resume
    python examples/train_lm.py --mesh none --steps 200 --out runs/one               # plain PyTorch, one device
"""
from __future__ import annotations

import argparse
import csv
import os
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

VOCAB = 256  # bytes


def corpus(megabytes: float) -> torch.Tensor:
    """The standard library's ``.py`` files in path order, as one stream of bytes (at most ``megabytes``)."""
    root, limit, chunks, size = Path(sysconfig.get_paths()["stdlib"]), int(megabytes * 2**20), [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or size >= limit:
            continue
        data = path.read_bytes()[: limit - size]
        chunks.append(data)
        size += len(data)
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def windows(tokens: torch.Tensor, seq: int) -> TensorDataset:
    """Non-overlapping windows of ``seq + 1`` tokens: inputs and their next tokens."""
    n = (len(tokens) - 1) // seq
    x = tokens[: n * seq].view(n, seq)
    y = tokens[1 : n * seq + 1].view(n, seq)
    return TensorDataset(x, y)


def model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(hidden_size=args.width, intermediate_size=args.width * 8 // 3 // 8 * 8 or 8,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, vocab_size=VOCAB, max_position_embeddings=args.seq,
                      use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg).to(getattr(torch, args.dtype)).train()


def next_token_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # (B, S, V)
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def loader(data: TensorDataset, args: argparse.Namespace, dp_size: int, dp_rank: int, epoch: int) -> DataLoader:
    sampler = DistributedSampler(data, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    sampler.set_epoch(epoch)
    return DataLoader(data, batch_size=args.batch // dp_size, sampler=sampler, drop_last=True)


def mesh_axes(spec: str, world: int | None) -> dict[str, int]:
    """``dp=2,tp=2`` as axis sizes; one axis may be ``*``: the world size over the other axes' product."""
    axes = dict(kv.split("=") for kv in spec.split(","))
    fill = [axis for axis, size in axes.items() if size == "*"]
    known = {axis: int(size) for axis, size in axes.items() if size != "*"}
    if not fill:
        return known
    rest = 1
    for size in known.values():
        rest *= size
    if len(fill) > 1:
        raise ValueError(f"--mesh {spec}: only one axis may be '*' ({' and '.join(fill)} are); give the others' sizes")
    if world is None:
        raise ValueError(f"--mesh {spec}: '*' takes the rest of torchrun's world size, and local ranks have none; "
                         f"give every size (e.g. {fill[0]}=2), or start the script under torchrun")
    if world % rest:
        raise ValueError(f"--mesh {spec}: the world size {world} does not divide by the other axes' product {rest}; "
                         f"start a multiple of {rest} ranks")
    return {axis: world // rest if axis == fill[0] else int(size) for axis, size in axes.items()}


def flops_per_token(m: torch.nn.Module, args: argparse.Namespace) -> float:
    """Training FLOPs per token: 6 per parameter plus attention's 12 * layers * width * sequence (PaLM's)."""
    return 6 * sum(p.numel() for p in m.parameters()) + 12 * args.layers * args.width * args.seq


def matmul_peak(dtype: torch.dtype) -> float:
    """This process's best measured matmul rate in ``dtype`` (FLOP/s): the MFU estimate's peak on a CPU."""
    a, best = torch.randn(512, 512, dtype=dtype), 0.0
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(4):
            a @ a
        best = max(best, 4 * 2 * 512**3 / (time.perf_counter() - start))
    return best


def train(args: argparse.Namespace) -> list[float]:
    """Trains on this process's rank (or alone with ``--mesh none``); the losses of the steps it ran."""
    import autopar

    data, m = windows(corpus(args.corpus_mb), args.seq), model(args)
    fpt, out = flops_per_token(m, args), Path(args.out)
    parallel = args.mesh != "none"
    if parallel:
        mesh = autopar.Mesh(**mesh_axes(args.mesh, int(os.environ["WORLD_SIZE"])))  # (torchrun and launch set it)
        pm = autopar.parallelize(m, mesh, loss_fn=next_token_loss, optimizer=optimizer, batch="local",
                                 microbatches=args.microbatches)
        dp_size, dp_rank, rank = pm.dp_size, pm.dp_rank, int(os.environ["RANK"])
    else:
        opt, dp_size, dp_rank, rank = optimizer(list(m.parameters())), 1, 0, 0
    position = {"step": 0, "epoch": 0, "index": 0}  # steps done; the epoch and the batch within it to run next
    if parallel and args.resume and (out / "checkpoint").exists():
        x, y = next(iter(loader(data, args, dp_size, dp_rank, 0)))
        pm.compile((x,), {}, y)  # (a checkpoint loads into a compiled program)
        try:
            position = pm.load(str(out / "checkpoint"))
        except FileNotFoundError:  # no save was committed yet (a job killed in its first save): start afresh
            pass
    peak = args.peak_tflops * 1e12 if args.peak_tflops else matmul_peak(getattr(torch, args.dtype))
    log, losses = (_metrics(out, resumed_at=position["step"]) if rank == 0 else None), []
    while position["step"] < args.steps:
        batches = list(loader(data, args, dp_size, dp_rank, position["epoch"]))[position["index"]:]
        for x, y in pm.batches(batches) if parallel else batches:  # (every rank has each batch, or an error)
            start = time.perf_counter()
            if parallel:
                loss = pm.step(x, target=y)
            else:
                loss_t = next_token_loss(m(x), y)
                loss_t.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                loss = float(loss_t.detach())
            seconds = time.perf_counter() - start
            position["step"], position["index"] = position["step"] + 1, position["index"] + 1
            losses.append(loss)
            step, tokens_per_s = position["step"], args.batch * args.seq / seconds
            mfu = fpt * tokens_per_s / (peak * (pm.mesh.size if parallel else 1))
            if log is not None:
                log.writerow([step, f"{loss:.17g}", f"{tokens_per_s:.0f}", f"{mfu:.4f}"])
                if step % args.log_every == 0 or step == args.steps:
                    print(f"step {step:5d}  loss {loss:.4f}  {tokens_per_s:9,.0f} tokens/s  MFU {mfu:6.1%} "
                          f"(of {peak / 1e9:,.1f} GFLOP/s per rank)", flush=True)
            if parallel and args.ckpt_every and step % args.ckpt_every == 0:
                pm.save(str(out / "checkpoint"), extra=dict(position))
            if step == args.steps:
                break
        else:
            position["epoch"], position["index"] = position["epoch"] + 1, 0
    if rank == 0:
        draw(out)
    return losses


def _metrics(out: Path, *, resumed_at: int) -> Any:
    """A CSV log on ``OUT/metrics.csv``: a new one, or, resuming after step ``resumed_at``, the old one without
    the rows of later steps (those a killed run logged after its last checkpoint). Each row is on disk once
    written (line buffering), so a job killed later keeps the steps it logged."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "metrics.csv"
    kept = [row for row in csv.reader(open(path)) if not row[0].isdigit() or int(row[0]) <= resumed_at] \
        if resumed_at > 0 and path.exists() else [["step", "loss", "tokens_per_s", "mfu"]]
    log = csv.writer(open(path, "w", newline="", buffering=1), lineterminator="\n")
    for row in kept:
        log.writerow(row)
    return log


def draw(out: Path) -> None:
    """``OUT/loss.png`` from ``OUT/metrics.csv`` (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows])
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title="train_lm.py")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", default="dp=2,tp=2",
                   help="axes as dp=2,pp=1,tp=2 (one may be '*': the rest of the world size), or 'none': plain PyTorch")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="the global batch (sequences per step)")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=50, help="0: never")
    p.add_argument("--peak-tflops", type=float, default=None, help="per rank; default: a measured matmul rate")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint where one was committed")
    p.add_argument("--out", default="runs/train_lm")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    if args.mesh == "none" or "RANK" in os.environ:  # one device, or this process is a torchrun rank
        train(args)
        return
    import autopar

    size = 1
    for n in mesh_axes(args.mesh, None).values():
        size *= n
    autopar.launch(train, size, args)


if __name__ == "__main__":
    main()
