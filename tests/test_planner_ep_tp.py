"""The planner's routed experts under expert parallelism combined with tensor parallelism (ep x tp).

Under ep the expert-parallel op is one node to the tp solver with every input replicated
(``passes/sharding.py``): each tp rank of an ep index holds that index's ``E / ep`` experts whole and runs them
on all the rows routed to them, while tp shards attention and the rest. So a rank's parameter bytes are the
dense parameters as tp shards them plus ``experts / ep`` whole (not ``experts / tp / ep``), and the experts'
FLOPs on a tp rank are not divided by tp. Checked against the formula, and against ``pm.memory()`` on four gloo
ranks at ``Mesh(dp=2, tp=2, ep=2)``.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.planner.cluster import Cluster
from autopar.planner.cost_model import PRECISIONS, Config, CostModel
from autopar.planner.expert_cost import ExpertProfile, routed
from autopar.planner.model_profile import b_sym, profile_model, s_sym

BATCH, SEQ, LAYERS = 8, 16, 1
FP32 = 4  # bytes per element


def _mixtral() -> torch.nn.Module:
    """A tiny Hugging Face ``MixtralForCausalLM`` (hidden 32, 4 experts of width 64, top-2), random weights."""
    return models.mixtral(layers=LAYERS)


@pytest.fixture(scope="module")
def cost() -> CostModel:
    profile = profile_model(_mixtral(), tp_sizes=(1, 2))
    return CostModel(profile, Cluster.preset("cpu"), PRECISIONS["fp32"], seq_len=SEQ)


def _expert_elements() -> int:
    """Elements of every layer's stacked expert tensors, all experts."""
    return sum(p.numel() for n, p in _mixtral().named_parameters() if ".experts." in n)


def _state(cost: CostModel, dp: int, tp: int, ep: int, zero: int) -> dict[str, float]:
    memory = cost.estimate(Config(dp=dp, tp=tp, ep=ep, zero=zero, microbatch_size=BATCH // dp), timed=False).memory
    return {k: float(memory[k]) for k in ("parameters", "gradients", "optimizer")}


def _held(cost: CostModel, dp: int, tp: int, ep: int, zero: int) -> dict[str, float]:
    """What the runtime holds per rank: the dense parameters as tp shards them (the plan at ep=1, whose stacked
    experts tp shards too, less those experts' ``1 / tp``) and ``1 / ep`` of the experts whole; ZeRO shards the
    dense state over dp, the experts' over the ``dp / ep`` ranks holding them; AdamW keeps two elements each."""
    experts = _expert_elements()
    dense = _state(cost, dp, tp, 1, 0)["parameters"] / FP32 - experts / tp
    held = experts / ep
    whole, sharded = dense + held, dense / dp + held / (dp // ep)
    return {"parameters": FP32 * (whole if zero < 3 else sharded), "gradients": FP32 * (whole if zero < 2 else sharded),
            "optimizer": 2 * FP32 * (sharded if zero else whole)}


@pytest.mark.parametrize("dp, tp, ep", [(2, 2, 2), (4, 2, 4), (4, 2, 2), (2, 1, 2)])
@pytest.mark.parametrize("zero", [0, 3])
def test_planned_expert_state_under_ep_and_tp_is_each_ranks_experts_whole(cost, dp: int, tp: int, ep: int,
                                                                          zero: int) -> None:
    assert _state(cost, dp, tp, ep, zero) == pytest.approx(_held(cost, dp, tp, ep, zero), rel=1e-9)


def test_ep_leaves_tp_only_and_ep_only_plans_as_they_were(cost) -> None:
    """Without ep the experts are tp's shards (the grouped form, and experts written as a loop); without tp,
    ``1 / ep`` of them."""
    experts = _expert_elements()
    tp_only, dp_only, ep_only = (_state(cost, 2, tp, ep, 0)["parameters"] for tp, ep in ((2, 1), (1, 1), (1, 2)))
    assert dp_only - tp_only > FP32 * experts / 2  # tp shards the experts (and more) at ep=1
    assert dp_only - ep_only == pytest.approx(FP32 * experts / 2, rel=1e-9)
    loop = ExpertProfile(tuple(dataclasses.replace(x, form="eager") for x in cost.experts.layers))
    for tp in (1, 2):
        values = cost.values(cost.profile.layers[0], tp, 1)
        assert routed(values, loop, 1, 1.0, SEQ).params == values.params


def test_expert_flops_on_a_tp_rank_are_whole(cost) -> None:
    """The experts run whole on each tp rank (at ep=1 the grouped matmul after gathering its weights, under ep
    the expert-parallel op): a layer's forward FLOPs at tp=2 are at least its experts' routed FLOPs (``2 k P_e``
    per token) and half of the rest, and ep with balanced routing adds nothing to the grouped form's."""
    at = {b_sym: 1, s_sym: SEQ}
    layer = cost.profile.layers[0]
    routed = sum(2 * x.top_k * x.per_expert for x in cost.experts.layers) / LAYERS * SEQ
    one, two = (float(cost.profile.part(layer, tp).flops.xreplace(at)) for tp in (1, 2))
    assert two >= routed + (one - routed) / 2
    for tp in (1, 2):
        values = cost.values(layer, tp, 1)
        assert cost._routed(values, 2, 1).flops == pytest.approx(values.flops, rel=1e-12)


# --- against a run: pm.memory() on 4 gloo ranks -----------------------------------------------------------------

def _measured(zero: int) -> dict[str, int]:
    ids = torch.randint(3, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    pm = parallelize(_mixtral(), Mesh(dp=2, tp=2, ep=2), loss_fn=models.lm_loss, optimizer=models.adamw, zero=zero)
    pm.step(ids, target=ids)
    return pm.memory()


@pytest.mark.parametrize("zero", [0, 3])
def test_planned_state_at_dp2_ep2_tp2_is_the_measured_one(cost, launcher, zero: int) -> None:
    """Parameter, gradient and AdamW bytes per rank within 5% of ``pm.memory()`` on every rank."""
    planned = _state(cost, 2, 2, 2, zero)
    for rank, memory in enumerate(launcher(_measured, 4, zero)):
        for key, want in planned.items():
            assert memory[key] == pytest.approx(want, rel=0.05), (rank, key, memory, planned)
