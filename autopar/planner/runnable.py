"""Whether autopar's runtime runs a planned configuration today, and why not (``Candidate.not_runnable``).

Invariant: a configuration marked runnable is one ``parallelize`` accepts and trains as one device would
(``tests/test_planner_runnable.py`` runs a covering sample); a refusal names what the runtime lacks.
"""
from __future__ import annotations

import torch

from autopar.core.mesh import AXES as MESH_AXES
from autopar.planner.cost_model import Config, Precision, precision_of
from autopar.planner.model_profile import ModelProfile


def not_runnable(config: Config, prec: Precision, profile: ModelProfile) -> str:
    """Why autopar's runtime cannot run ``config`` today ("" when it can)."""
    if config.ep > 1 and (why := expert_parallel_refused(config, prec, profile)):
        return why
    if config.cp > 1 and (why := context_parallel_refused(config, prec, profile)):
        return why
    if profile.updated_buffers and (config.pp > 1 or config.microbatches > 1):
        return (f"the model updates buffers in forward ({', '.join(profile.updated_buffers[:2])}), which autopar "
                f"runs with pp=1 and one microbatch only (program.check_buffer_updates)")
    if prec.name in ("bf16", "mixed") and profile.dtype == torch.float32:
        return ""  # precision="bf16" (the fp32 parameters are the masters) or "mixed" (masters in the optimizer)
    if prec != precision_of(profile.dtype):
        return (f"autopar runs the model in its own dtype ({profile.dtype}) or, for a float32 model, in bf16 with "
                f"float32 masters (precision='bf16' or 'mixed'), not {prec.name} precision")
    return ""


def expert_parallel_refused(config: Config, prec: Precision, profile: ModelProfile) -> str:
    """Why ``config``'s expert parallelism is not offered ("" when it is): the runtime runs it with dp, pp, tp,
    ZeRO 1-3, hybrid sharding, bf16/mixed precision and recomputation, on experts written as a loop or as Hugging
    Face's grouped matmul (``passes/expert_parallel.check_composes``); the search does not weigh it with hybrid
    sharding."""
    if config.dp_shard:
        return (f"the planner does not model expert parallelism (ep={config.ep}) with hybrid sharding; the runtime "
                f"runs it when given the mesh, Mesh(dp=({config.replicas}, {config.dp_shard}), ep={config.ep})")
    return ""


def context_parallel_refused(config: Config, prec: Precision, profile: ModelProfile) -> str:
    """Why the runtime refuses ``config``'s context parallelism ("" when it runs it): ``Mesh(dp=, cp=, pp=, tp=)``
    composes with ZeRO 1-3, bf16/mixed precision and recomputation (``program.check_context_parallel``; hybrid
    sharding and ep under cp are not configurations), and needs a runtime with the ``cp`` axis; it rewrites
    ``scaled_dot_product_attention`` only (an eager matmul-softmax-matmul attention is refused); usp runs
    attentions without a mask tensor only."""
    if "cp" not in MESH_AXES:
        return f"context parallelism (cp={config.cp}) needs a runtime with the cp mesh axis; this one has none"
    if profile.eager_attention:
        return (f"context parallelism (cp={config.cp}) rewrites scaled_dot_product_attention only, and this model "
                f"computes attention eagerly ({profile.eager_attention}); load it with attn_implementation='sdpa'")
    if config.cp_attention == "usp" and profile.masked_attention:
        return ("cp_attention='usp' runs attentions without a mask tensor only, and this model's attention takes "
                "one; the ring and the all-to-all run it")
    return ""
