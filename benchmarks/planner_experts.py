"""The planner's expert-parallel choice for Mixtral-8x7B and a DeepSeek-V3-like model (docs/planner.md's tables).

Each model is built on the meta device from its published Hugging Face configuration, its experts a loop
(``_experts_implementation = "eager"``: what autopar's expert parallelism runs), and planned on DGX-A100 nodes
(8 GPUs per node, NVLink inside, 4 x 200 Gb/s InfiniBand between: ``Cluster.preset("dgx-a100")``) in mixed
precision with Adam. For every ep degree searched the best configuration with that degree is printed:
its step time, the experts' compute (``ExpertLayerProfile.flops_per_token``: dense dispatch at ep=1, routed
top-k times the imbalance under ep), the all-to-all time and link, memory per device, and whether autopar's
runtime runs it today. Then the explanation's ep sentences for the best configuration.

Run: PYTHONPATH=. python benchmarks/planner_experts.py [--model mixtral|deepseek|both] [--imbalance 1.0]
"""
from __future__ import annotations

import argparse
import time

import torch

from autopar.planner import plan
from autopar.planner.cluster import gb
from autopar.planner.expert_report import expert_reasons, expert_seconds


def mixtral_8x7b() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=32768, use_cache=False)
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg)
    model.config._experts_implementation = "eager"
    return model


def deepseek_v3_like() -> torch.nn.Module:
    """DeepSeek-V3's published shape (61 layers, the first 3 dense; 256 routed experts of width 2,048, top-8 in
    4 of 8 groups, one shared expert; multi-head latent attention) without the multi-token-prediction module."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(use_cache=False)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    model.config._experts_implementation = "eager"
    return model


MODELS = {"mixtral": ("Mixtral-8x7B", mixtral_8x7b, 64, 256, 4096),
          "deepseek": ("DeepSeek-V3-like", deepseek_v3_like, 256, 1024, 4096)}


def report(key: str, imbalance: float) -> None:
    name, build, devices, batch, seq = MODELS[key]
    start = time.perf_counter()
    result = plan(build(), devices, cluster="dgx-a100", global_batch=batch, seq_len=seq, precision="mixed",
                  optimizer="adam", expert_imbalance=imbalance, top=20)
    experts = result.profile.experts
    print(f"\n{name}: {result.profile.total_params / 1e9:.1f}B parameters, {len(experts.layers)} expert layers "
          f"({sum(x.params for x in experts.layers) / 1e9:.1f}B in experts), {devices} A100s, batch {batch}x{seq}, "
          f"imbalance {imbalance:g}; planned in {time.perf_counter() - start:.0f} s, {result.considered} "
          "configurations")
    print("| ep | best configuration with it | step | experts' compute | all-to-all | dp/ZeRO exposed | memory/device "
          "| autopar runs it |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    best: dict[int, object] = {}
    for c in result.candidates:
        if c.fits:
            best.setdefault(c.config.ep, c)
    for ep, c in sorted(best.items()):
        t = {k: float(v) for k, v in c.estimate.time.items()}
        print(f"| {ep} | {c.config.describe()} | {c.step_time:.2f} s | {expert_seconds(result, c.config):.2f} s | "
              f"{t['expert_parallel']:.2f} s | {t['data_parallel'] + t['contention']:.2f} s | {gb(c.total_memory)} | "
              f"{'yes' if c.runnable else 'no: ' + c.not_runnable} |")
    print(f"best: {result.best.config.describe()}")
    for line in expert_reasons(result):
        print(f"- {line}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="both", choices=["mixtral", "deepseek", "both"])
    p.add_argument("--imbalance", type=float, default=1.0, help="the busiest rank's routed rows over the mean")
    args = p.parse_args()
    for key in (["mixtral", "deepseek"] if args.model == "both" else [args.model]):
        report(key, args.imbalance)


if __name__ == "__main__":
    main()
