"""Sequence parallelism (``sequence_parallel=True``): the solver shards the values between tensor-parallel regions,
each forward all-reduce becomes a reduce-scatter and an all-gather; float64 exact, dropout the same numbers as the
replicated plan draws, and the activations saved per rank lower by what the solver predicts."""
from __future__ import annotations

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.core.plan import CollectiveRow, MatmulRow
from autopar.testing import assert_equivalent, parallel_run, relative_errors
from harness.probe import saved_tensors

IDS = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(2))
ONE_SEQUENCE = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(3))  # only the sequence divides


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_float64_exact(launcher, name: str) -> None:
    assert_equivalent(models.factory(getattr(models, name)), Mesh(tp=2), (IDS,), TARGET, models.lm_loss, models.adamw,
                      steps=2, rtol=1e-9, atol=1e-10, launcher=launcher, sequence_parallel=True)


@pytest.mark.parametrize("name, mesh, options", [
    ("gpt2", Mesh(dp=2, tp=2), {}),
    ("llama", Mesh(pp=2, tp=2), {"microbatches": 2}),
    ("gpt2", Mesh(dp=2, tp=2), {"zero": 3}),
    pytest.param("llama", Mesh(tp=2), {"recompute": "selective"}, marks=pytest.mark.slow),
    pytest.param("gpt2", Mesh(pp=2, tp=2), {"microbatches": 2, "schedule": "zb-h1"}, marks=pytest.mark.slow),
])
def test_float64_exact_composed(launcher, name: str, mesh: Mesh, options: dict) -> None:
    layers = 4 if mesh.pp > 1 else 2
    assert_equivalent(models.factory(getattr(models, name), layers=layers), mesh, (IDS,), TARGET, models.lm_loss,
                      models.adamw, steps=2, rtol=1e-9, atol=1e-10, launcher=launcher, sequence_parallel=True,
                      **options)


def test_one_sequence_is_sharded_along_the_sequence(launcher) -> None:
    """A batch of one: the values between regions can only be sharded along the sequence (dim 1)."""
    pm = parallelize(models.llama(), Mesh(tp=2), example_inputs=(ONE_SEQUENCE,), example_target=ONE_SEQUENCE,
                     loss_fn=models.lm_loss, optimizer=models.adamw, sequence_parallel=True)
    gm = pm.graph(0)
    dims = {(nd.target._opname, nd.args[2]) for nd in gm.graph.nodes
            if getattr(nd.target, "namespace", None) == "autopar" and nd.target._opname in ("reduce_scatter",
                                                                                               "all_gather_rs")}
    assert dims == {("reduce_scatter", 1), ("all_gather_rs", 1)}, dims
    assert_equivalent(models.factory(models.llama), Mesh(tp=2), (ONE_SEQUENCE,), ONE_SEQUENCE, models.lm_loss,
                      models.adamw, steps=2, rtol=1e-9, atol=1e-10, launcher=launcher, sequence_parallel=True)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_plan_shows_megatrons_pairs(name: str) -> None:
    """In every layer each forward all-reduce after a row-parallel matmul is a reduce-scatter, and each
    column-parallel group reads an all-gather whose backward reduce-scatters; the weights are sharded as without."""
    def compiled(sp: bool):
        return parallelize(getattr(models, name)(), Mesh(tp=2), example_inputs=(IDS,), example_target=TARGET,
                           loss_fn=models.lm_loss, optimizer=models.adamw, sequence_parallel=sp)

    pm, plain = compiled(True), compiled(False)
    rows = pm.plan.tensor_parallel.rows
    ops = [row.op for row in rows if isinstance(row, CollectiveRow) and row.op != "grad_all_reduce"]
    pairs = ["all_gather_rs", "reduce_scatter"] * 2
    assert ops in (pairs, pairs[1:] + pairs[:1]), rows  # (a layer may begin with the last one's reduce-scatter)
    styles = [row.style for row in rows if isinstance(row, MatmulRow) and row.op != "scaled_dot_product_attention"]
    before = [row.style for row in plain.plan.tensor_parallel.rows
              if isinstance(row, MatmulRow) and row.op != "scaled_dot_product_attention"]
    assert styles == before  # the same column- and row-parallel matmuls
    forward = {c.op: c.count for c in pm.plan.collectives if c.direction == "forward"}
    plain_forward = {c.op: c.count for c in plain.plan.collectives if c.direction == "forward"}
    assert forward["reduce_scatter"] == forward["all_gather"] == plain_forward["all_reduce"] - forward.get("all_reduce", 0)
    text = str(pm.plan)
    assert "sequence parallel:" in text and "reduce_scatter" in text
    assert pm.plan.tensor_parallel.saved[0] < pm.plan.tensor_parallel.saved[1]


def _dropout_run(sp: bool, launcher) -> list:
    make = models.factory(models.gpt2, dropout=0.1)
    return parallel_run(make, Mesh(tp=2), (IDS,), TARGET, models.lm_loss, models.adamw, 2, launcher=launcher,
                        sequence_parallel=sp)


def test_dropout_draws_the_replicated_plans_numbers(launcher) -> None:
    """Dropout on sequence shards applies each rank's part of one mask: the same numbers as the plan that runs
    it replicated (a mask drawn per shard would repeat itself across ranks); not those of no dropout."""
    replicated, sharded = _dropout_run(False, launcher), _dropout_run(True, launcher)
    without = models.loss_without_dropout(models.factory(models.gpt2, dropout=0.1), IDS, TARGET)
    assert replicated[0].losses[0] != pytest.approx(without, rel=1e-6)  # the tp runs drop
    assert relative_errors(replicated[0], sharded[0])[0] < 1e-12
    worst = max(float((replicated[0].state[k] - sharded[0].state[k]).abs().max()) for k in replicated[0].state)
    assert worst < 1e-12


def _saved_bytes(sp: bool) -> tuple[int, tuple[int, int]]:
    """Bytes of the distinct storages one forward saves for backward on this rank (parameters aside).

    Under sequence parallelism the runtime's own saved-tensor hooks keep gathered activations as their shards
    (``runtime/regather.py``); ``saved_tensors`` counts what they keep.
    """
    ids = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(4))
    pm = parallelize(models.gpt2(d=64), Mesh(tp=2), loss_fn=models.lm_loss, optimizer=models.sgd,
                     sequence_parallel=sp)
    pm.step(ids, target=ids)  # compile and warm up
    with saved_tensors() as saved:
        pm.step(ids, target=ids)
    plan = parallelize(models.gpt2(d=64), Mesh(tp=2), example_inputs=(ids,), example_target=ids,
                       loss_fn=models.lm_loss, optimizer=models.sgd, sequence_parallel=True).plan
    return saved.bytes(), plan.tensor_parallel.saved


def test_activation_memory_is_lower_by_the_predicted_amount(launcher) -> None:
    (sharded, predicted), _ = launcher(_saved_bytes, 2, True)
    (replicated, _), _ = launcher(_saved_bytes, 2, False)
    assert sharded == pytest.approx(predicted[0], rel=0.10)
    assert replicated == pytest.approx(predicted[1], rel=0.10)
    assert replicated - sharded == pytest.approx(predicted[1] - predicted[0], rel=0.10)


def _gathers_per_step(name: str) -> tuple[dict, dict]:
    pm = parallelize(getattr(models, name)(d=64), Mesh(tp=2), loss_fn=models.lm_loss, optimizer=models.sgd,
                     sequence_parallel=True)
    pm.step(IDS, target=TARGET)
    before = pm.communication(calls=True)
    pm.step(IDS, target=TARGET)
    calls = {k: v - before.get(k, 0) for k, v in pm.communication(calls=True).items()}
    planned = {(c.op, c.direction): c.count for c in pm.plan.collectives}
    return calls, planned


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_backward_gathers_the_kept_shards_again(launcher, name: str) -> None:
    """Each column-parallel input is kept as its shard and gathered again in backward (Megatron-LM's sequence
    parallelism): one backward all-gather per forward one, beyond the reduce-scatters' own; the plan counts
    the calls the runtime makes. LLaMA's query, key and value projections (and gate and up) read one gathered
    value: its handles share one backward gather."""
    for calls, planned in launcher(_gathers_per_step, 2, name):
        forward = planned[("all_gather", "forward")]
        assert forward > 0
        assert planned[("all_gather", "backward")] == planned[("reduce_scatter", "forward")] + forward
        assert calls["all_gather@tp"] == forward + planned[("all_gather", "backward")]


def test_needs_a_tensor_parallel_axis() -> None:
    with pytest.raises(ValueError, match="tp=1"):
        parallelize(models.gpt2(), Mesh(dp=2), example_inputs=(IDS,), example_target=TARGET, loss_fn=models.lm_loss,
                    optimizer=models.adamw, sequence_parallel=True)


# -- the planner ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def profile():
    from autopar.planner.model_profile import profile_model

    return profile_model(models.gpt2(layers=4, d=64, heads=4, vocab=128, dtype=torch.float32), tp_sizes=(1, 2))


def test_the_planner_charges_less_activation_memory_with_it(profile) -> None:
    """At tp=2 with every recompute mode, sequence parallelism keeps fewer activation bytes (the layer inputs that
    recomputation keeps are shards too). It communicates what the plain plan does (each all-reduce an all-gather
    and a reduce-scatter) plus one all-gather in backward per forward one: the column-parallel inputs, kept as
    shards, gathered again; plus the all-reduce of each norm's weight gradient (the norm sees only its shard of
    the tokens), at the weight's size, as Megatron-LM all-reduces them."""
    from autopar.planner.cluster import Cluster
    from autopar.planner.cost_model import PRECISIONS, Config, CostModel

    cost = CostModel(profile, Cluster.preset("dgx-a100"), PRECISIONS["fp32"], seq_len=32)
    for rc in ("none", "selective", "full"):
        plain = cost.estimate(Config(dp=1, tp=2, microbatch_size=4, recompute=rc))
        sharded = cost.estimate(Config(dp=1, tp=2, microbatch_size=4, recompute=rc, sequence_parallel=True))
        assert float(sharded.memory["activations"]) < 0.95 * float(plain.memory["activations"]), rc
    layer = next(seg for seg in profile.segments if seg.kind == "layer")
    moved = {}
    for name, part in (("plain", layer.parts[2]), ("sp", layer.sequence_parallel[2])):
        for c in part.collectives:
            moved[name] = moved.get(name, 0) + c.elements * (2 if c.op == "all_reduce" else 1)
    sp = layer.sequence_parallel[2].collectives
    def elements(op: str, direction: str) -> object:
        return sum(c.elements for c in sp if c.op == op and c.direction == direction)

    gathered = elements("all_gather", "forward")
    assert gathered != 0  # a reduce-scatter's backward gathers, and so does each column-parallel input's again
    assert elements("all_gather", "backward") == elements("reduce_scatter", "forward") + gathered
    norms = sum(c.elements for c in sp if c.op == "all_reduce" and not getattr(c.elements, "free_symbols", ()))
    assert norms != 0
    assert moved["sp"] == moved["plain"] + gathered + 2 * norms


def test_the_planner_chooses_it_where_memory_is_short(profile) -> None:
    import dataclasses

    from autopar.planner import plan
    from autopar.planner.cluster import Cluster
    from autopar.planner.cost_model import PRECISIONS, Config, CostModel

    cpu = Cluster.preset("cpu")
    cost = CostModel(profile, cpu, PRECISIONS["fp32"], seq_len=32)
    config = Config(dp=1, tp=2, microbatches=8, microbatch_size=1)  # the least memory without recomputation
    budget = float(cost.estimate(dataclasses.replace(config, sequence_parallel=True)).total_memory)
    assert float(cost.estimate(config).total_memory) > budget  # so nothing fits without sequence parallelism
    options = dict(global_batch=8, seq_len=32, profile=profile, precision="fp32", tp=(2,), recompute=("none",),
                   max_microbatch=8)
    result = plan(None, 2, cluster=cpu.replace(memory=budget), **options)
    assert result.best.config == dataclasses.replace(config, sequence_parallel=True)
    assert result.best.parallelize_options()["sequence_parallel"] is True
    assert "+sp" in result.table(1).splitlines()[1] and "sequence parallelism: the values between" in str(result)
    roomy = plan(None, 2, cluster=cpu, **options)  # where everything fits, it is not worth its extra calls
    assert not roomy.best.config.sequence_parallel


def test_values_between_layers_stay_sharded() -> None:
    """The residual stream crosses each layer boundary (what a pipeline cut sends) as sequence shards, not as
    partial sums of the whole activation: reducing before or after a residual add costs the same, and the
    solver breaks that tie toward the fewer bytes (a GPT-3 530B-wide 2-layer model at tp=8, where it once
    picked the partial sums)."""
    from autopar.compiler.capture import capture
    from autopar.passes.stage_cuts import node_layer
    from autopar.passes.tensor_parallel import tensor_parallel
    from autopar.planner.fake_cpu import as_fake_cpu
    from autopar.planner.gpt import gpt
    from autopar.planner.profile_graph import ORIGIN

    model = gpt(2, 20480, 128)
    with as_fake_cpu(model):
        cap = capture(model, (torch.randint(0, 51200, (2, 16)),), {})
    by_name = {nd.name: nd for nd in cap.gm.graph.nodes}
    for nd in cap.gm.graph.nodes:
        nd.meta[ORIGIN] = nd.name  # (the lowering keeps it on the node it makes from each captured one)
    crossing = {nd.name for nd in cap.gm.graph.nodes if nd.op == "call_function" and "val" in nd.meta
                and any(node_layer(u) != node_layer(nd) for u in nd.users) and node_layer(nd) is not None}
    assert crossing
    lowered = tensor_parallel(cap, 8, {n for n, _ in model.named_parameters()}, sequence_parallel=True).graphs[0]
    checked = [nd for nd in lowered.graph.nodes if nd.meta.get(ORIGIN) in crossing]
    assert len(checked) == len(crossing), sorted(crossing - {nd.meta.get(ORIGIN) for nd in checked})
    for nd in checked:
        whole = by_name[nd.meta[ORIGIN]].meta["val"].numel()
        assert nd.meta["val"].numel() * 8 == whole, (nd.name, tuple(nd.meta["val"].shape))
