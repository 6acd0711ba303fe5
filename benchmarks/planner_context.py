"""The planner's context-parallel choice for LLaMA-3 8B at long sequences (docs/planner.md's tables).

LLaMA-3 8B (``autopar.planner.llama.llama3_8b``: 32 layers, hidden 4,096, 32 heads, 8 key/value heads,
feed-forward 14,336) on the meta device, planned at 131,072 tokens per sequence on 64 H100
(``Cluster.preset("grand-teton-h100")``: 8 per node, 90 GB for training) in bf16 with Adam, global batch 8. For
every cp degree searched the best configuration with that degree is printed: memory per device (activations
apart), step time, the ring's bytes and exposed seconds, tokens/s per GPU and whether autopar's runtime runs
it today; then the explanation's cp sentence.

``--torchtitan`` prints the planner's numbers for the setups of torchtitan's published 8B FSDP + CP runs
(benchmarks/llama3_h100_202412_torchtitan.md in torchtitan, Table 2: 8 H100, local batch 1, full
recomputation, compiled with Float8: FSDP 8 CP 1 at 32,768 tokens, FSDP 4 CP 2 at 65,536, FSDP 2 CP 4 at
131,072, FSDP 1 CP 8 at 262,144) beside their tokens/s per GPU. Float8 is not modelled (bf16 here), so
only the trend is comparable.

Run: PYTHONPATH=. python benchmarks/planner_context.py [--torchtitan]
"""
from __future__ import annotations

import argparse
import time

from autopar.planner import plan
from autopar.planner.cluster import Cluster, gb
from autopar.planner.config import Config
from autopar.planner.context_report import context_reasons
from autopar.planner.cost_model import PRECISIONS, CostModel
from autopar.planner.llama import llama3_8b
from autopar.planner.model_profile import profile_model

TORCHTITAN = [(8, 1, 32768, 3890), (4, 2, 65536, 2540), (2, 4, 131072, 1071), (1, 8, 262144, 548)]  # Table 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torchtitan", action="store_true", help="also torchtitan's 8B FSDP + CP setups")
    args = parser.parse_args()
    start = time.process_time()
    profile = profile_model(llama3_8b(), sequence=True, tp_sizes=(1, 2, 4, 8))
    result = plan(None, 64, cluster="grand-teton-h100", global_batch=8, seq_len=131072, precision="bf16",
                  profile=profile, top=20)
    print(f"LLaMA-3 8B, 64 x H100, global batch 8 x 131,072 tokens, bf16: {result.considered} configurations in "
          f"{time.process_time() - start:.1f} s CPU")
    print(f"{'cp':>3}  {'best configuration':<62} {'state':>8} {'activ.':>8} {'step':>8} {'ring exp.':>9} "
          f"{'ring/rank':>10} {'TPS/GPU':>8}  run")
    for cp in sorted({c.config.cp for c in result.every.values()}):
        fitting = [c for c in result.candidates if c.fits and c.config.cp == cp]
        if not fitting:
            least = min((c for c in result.every.values() if c.config.cp == cp), key=lambda c: c.total_memory)
            print(f"{cp:>3}  nothing fits; smallest {least.config.describe()}: {gb(least.total_memory)}")
            continue
        c = fitting[0]
        state = c.memory["parameters"] + c.memory["gradients"] + c.memory["optimizer"]
        _, _, ring = result.cost.ring_exchanges(c.config)
        print(f"{cp:>3}  {c.config.describe():<62} {gb(state):>8} {gb(c.memory['activations']):>8} "
              f"{c.step_time:>7.2f}s {float(c.estimate.time['context_parallel']) * 1e3:>7.1f}ms "
              f"{gb(float(ring)):>10} {c.estimate.tokens_per_s / 64:>8,.0f}  {'yes' if c.runnable else 'no'}")
    for line in context_reasons(result):
        print("-", line)
    if args.torchtitan:
        cluster = Cluster.preset("grand-teton-h100")
        print("\ntorchtitan's 8B FSDP + CP setups on 8 H100 (local batch 1, full recomputation; theirs compiled, "
              "Float8; the planner's bf16)")
        print(f"{'FSDP':>4} {'CP':>3} {'tokens':>8} {'planner TPS/GPU':>16} {'torchtitan':>11} {'activ.':>8} "
              f"{'total':>8} {'ring exp.':>9}")
        for dp, cp, seq, published in TORCHTITAN:
            cost = CostModel(profile, cluster, PRECISIONS["bf16"], seq_len=seq)
            est = cost.estimate(Config(dp=dp, cp=cp, zero=3, recompute="full"))
            print(f"{dp:>4} {cp:>3} {seq:>8,} {float(est.tokens_per_s) / 8:>16,.0f} {published:>11,} "
                  f"{gb(float(est.memory['activations'])):>8} {gb(float(est.total_memory)):>8} "
                  f"{float(est.time['context_parallel']) * 1e3:>7.1f}ms")


if __name__ == "__main__":
    main()
