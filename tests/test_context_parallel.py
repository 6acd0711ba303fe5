"""Context parallelism (``Mesh(cp=...)``): ring attention over balanced sequence chunks equals one device."""
from __future__ import annotations

import pytest
import torch

import autopar
import models
from autopar import Mesh
from autopar.core.errors import UnsupportedError
from autopar.testing import assert_equivalent

IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
TARGET = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_cp2_equals_one_device(launcher, name: str) -> None:
    """Causal attention rewritten to a ring over two ranks; positions (learned, RoPE) global; AdamW."""
    assert_equivalent(models.factory(getattr(models, name)), Mesh(cp=2), (IDS,), TARGET, models.lm_loss,
                      models.adamw, steps=2, rtol=1e-9, atol=1e-10, launcher=launcher)


def test_cp2_counts_ignored_labels_over_the_whole_sequence(launcher) -> None:
    """Labels ignored (-100) on one rank's chunk only: the loss divides by the global count, not each rank's.
    SGD, whose update is proportional to the gradient, so that a gradient off by a count's factor shows in the
    updates as well as in the loss (AdamW's update is nearly scale-free, and it turns the rounding of a gradient
    element near zero into an update error of its own: 1e-11 on a CPU without AVX-512, whose sums round
    otherwise)."""
    target = TARGET.clone()
    target[:, 6:] = -100  # chunk 3 of 4: cp rank 0's tail
    target[0, 1] = -100
    assert_equivalent(models.factory(models.gpt2), Mesh(cp=2), (IDS,), target, models.lm_loss, models.sgd,
                      steps=2, rtol=1e-9, atol=1e-10, launcher=launcher)


def test_cpu_kernel_form_is_rewritten(launcher) -> None:
    """An attention written with SDPA's CPU kernel ``_scaled_dot_product_flash_attention_for_cpu``."""
    assert_equivalent(models.factory(models.kernel_attention), Mesh(cp=2), (IDS,), TARGET, models.lm_loss,
                      models.adamw, steps=2, rtol=1e-9, atol=1e-10, launcher=launcher)


def test_dp2_cp2_microbatches_with_ignored_labels(launcher) -> None:
    """Four parts of the batch (dp x microbatches), each cut over cp; labels ignored unevenly among them."""
    ids = torch.cat([IDS, IDS.flip(0)])
    target = torch.cat([TARGET, TARGET.flip(1)])
    target[0, 6:] = -100
    target[3, :3] = -100
    assert_equivalent(models.factory(models.llama), Mesh(dp=2, cp=2), (ids,), target, models.lm_loss, models.adamw,
                      steps=2, rtol=1e-9, atol=1e-10, launcher=launcher, microbatches=2)


def test_bert_bidirectional_cp2(launcher) -> None:
    """No causal mask: every block is computed; BERT's position-id buffer is indexed at global positions."""
    assert_equivalent(models.factory(models.bert), Mesh(cp=2), (IDS,), TARGET, models.lm_loss, models.adamw,
                      steps=2, rtol=1e-9, atol=1e-10, launcher=launcher)


IDS16 = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
TARGET16 = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("name, mesh", [
    ("gpt2", Mesh(cp=4)), ("llama", Mesh(dp=2, cp=2)),
    pytest.param("llama", Mesh(cp=4), marks=pytest.mark.slow), pytest.param("gpt2", Mesh(dp=2, cp=2), marks=pytest.mark.slow),
])
def test_wider_meshes_equal_one_device(launcher, name: str, mesh: Mesh) -> None:
    assert_equivalent(models.factory(getattr(models, name)), mesh, (IDS16,), TARGET16, models.lm_loss,
                      models.adamw, steps=2, rtol=1e-9, atol=1e-10, launcher=launcher)


def test_model_loss_shifts_labels_across_chunks(launcher) -> None:
    """GPT-2 computing its own loss from ``labels=`` (shifted inside the loss): the shift is done on the whole
    sequence before the cut, so each chunk's last token is scored against the next chunk's first.

    Hugging Face computes that loss in float32 even for a float64 model, so sums over the ranks' chunks round
    differently from one device: the bounds are float32's (a wrong shift is off by far more)."""
    labels = TARGET.clone()
    labels[1, 3] = -100
    assert_equivalent(models.factory(models.gpt2), Mesh(cp=2), (IDS,), None, None, models.adamw, steps=2,
                      rtol=1e-6, atol=1e-7, update_rtol=1e-5, kwargs={"labels": labels}, launcher=launcher)


def _compile(make: object, mesh: Mesh, ids: torch.Tensor, target: torch.Tensor | None, loss_fn: object = None,
             **kwargs: object) -> None:
    pm = autopar.parallelize(make(), mesh, loss_fn=loss_fn or models.lm_loss, optimizer=models.adamw)
    pm.compile((ids,), kwargs, target)


def test_sequence_not_divisible_by_two_cp_is_refused() -> None:
    with pytest.raises(UnsupportedError, match=r"sequence length 6 does not divide by 2 x cp = 4.*multiple of 4"):
        _compile(models.gpt2, Mesh(cp=2), IDS[:, :6], TARGET[:, :6])


def test_eager_attention_is_refused() -> None:
    """Gemma-2 in eager attention (matmul-softmax-matmul, sliding-window masks): refused, naming the node."""
    with pytest.raises(UnsupportedError, match=r"relates the local sequence \(4 tokens\) to itself.*sdpa"):
        _compile(models.gemma2, Mesh(cp=2), IDS, TARGET)


def test_sliding_window_covering_the_sequence_runs(launcher) -> None:
    """A window as long as the sequence is plain causal attention, on one device and on the ring alike."""
    assert_equivalent(models.factory(models.mistral, window=8), Mesh(cp=2), (IDS,), TARGET, models.lm_loss,
                      models.adamw, steps=2, rtol=1e-9, atol=1e-10, launcher=launcher)


def test_shift_inside_the_loss_is_refused() -> None:
    """A loss that shifts logits and targets itself (``[:, :-1]``, ``[:, 1:]``) would cut across the chunks."""
    def shifted_loss(out: object, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))
    with pytest.raises(UnsupportedError, match=r"slices \[.*\] along a dim of the local sequence length 4"):
        _compile(models.gpt2, Mesh(cp=2), IDS, TARGET, loss_fn=shifted_loss)


def test_mesh_layout_and_gradient_group() -> None:
    """cp is its own axis (it multiplies the world size); gradients are averaged over dp x cp."""
    mesh = Mesh(dp=2, cp=2)
    assert mesh.size == 4 and mesh.groups("cp") == [[0, 1], [2, 3]] and mesh.groups("dp") == [[0, 2], [1, 3]]
    assert mesh.groups("dp_cp") == [[0, 1, 2, 3]] and Mesh(cp=2, tp=2).group_of(1, "dp_cp") == [1, 3]


def _random_mask(shape: tuple[int, ...], kind: str) -> torch.Tensor:
    """A boolean or float (additive) mask with a row no key may attend and the block (query chunk 0, key
    chunk 1) of chunks of 4 entirely masked."""
    mask = torch.rand(shape) < 0.6
    mask[:, :, 5] = False
    mask[:, :, :4, 4:8] = False
    if kind == "float":
        return torch.zeros(shape, dtype=torch.float64).masked_fill(~mask, float("-inf")) + torch.rand(shape)
    return mask


def _ring_against_sdpa(causal: bool, mask_kind: str | None = None) -> float:
    """On each rank: the worst relative error of ring attention's output and q/k/v gradients on the rank's
    chunks against SDPA on the whole sequence (float64), with a random mask of ``mask_kind`` if given."""
    import torch.distributed as dist

    from autopar.core.collectives import Binding, bind
    from autopar.core.ring_attention import positions

    cp, me = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8 * cp, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = _random_mask((2, 3, 8 * cp, 8 * cp), mask_kind) if mask_kind else None
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=0.3)
    grad = torch.randn_like(whole)
    want = [whole, *torch.autograd.grad(whole, (q, k, v), grad)]
    pos = positions(8, cp, me)
    mine = [x.detach()[:, :, pos].requires_grad_() for x in (q, k, v)]
    with bind(Binding({"cp": dist.group.WORLD})):
        out, _ = torch.ops.autopar.ring_attention(*mine, 0.3, causal, "cp", None if mask is None else mask[:, :, pos])
        got = [out, *torch.autograd.grad(out, mine, grad[:, :, pos])]
    return float(torch.stack([(a - b[:, :, pos]).abs().max() / b.abs().max() for a, b in zip(got, want)]).max())


def _ring_exchanges() -> tuple[dict[str, int], dict[str, int], list[tuple[int, int]]]:
    """One step of LLaMA at cp=2: the exchanges run (calls, bytes) and the plan's (calls, bytes) per direction."""
    pm = autopar.parallelize(models.llama(), Mesh(cp=2), loss_fn=models.lm_loss, optimizer=models.adamw)
    pm.step(IDS, target=TARGET)
    return (pm.communication(calls=True), pm.communication(),
            [(c.count, c.bytes) for c in pm.plan.collectives if c.axis == "cp"])


def test_ring_exchanges_run_as_planned(launcher) -> None:
    for calls, sent, planned in launcher(_ring_exchanges, 2):
        assert (calls["ring_send_recv@cp"], sent["ring_send_recv@cp"]) == tuple(map(sum, zip(*planned)))


@pytest.mark.parametrize("cp, causal, mask_kind", [(2, True, None), (2, False, None), (4, True, None),
                                                   (2, False, "bool"), (2, False, "float"), (4, False, "bool")])
def test_ring_attention_op_equals_sdpa(launcher, cp: int, causal: bool, mask_kind: str | None) -> None:
    """The op alone: output and gradients of q, k, v on each rank's chunks equal SDPA's on the sequence; with a
    boolean or float mask per head, rows no key may attend give 0 as SDPA's do (a NaN fails the bound)."""
    assert all(error < 1e-13 for error in launcher(_ring_against_sdpa, cp, causal, mask_kind))  # (NaN fails)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_blocks_are_balanced_and_empty_ones_skipped(cp: int) -> None:
    """Each rank computes the same number of (query chunk, key chunk) pairs, and together exactly the pairs a
    causal mask leaves non-empty: (2 cp)(2 cp + 1) / 2 of the (2 cp)^2."""
    from autopar.core.ring_attention import _pairs

    per_rank = [sum(len(_pairs(cp, me, src, True)) for src in range(cp)) for me in range(cp)]
    assert len(set(per_rank)) == 1 and sum(per_rank) == 2 * cp * (2 * cp + 1) // 2
    assert sum(len(_pairs(cp, me, src, False)) for me in range(cp) for src in range(cp)) == (2 * cp) ** 2


def test_plan_and_graph_show_the_ring() -> None:
    """``pm.graph(rank)`` calls the ring by name with its axis, positions are the op's, and ``pm.plan`` counts
    the exchanges: cp - 1 K/V blocks per attention forward; backward cp - 1 K/V blocks and cp gradient sums."""
    pm = autopar.parallelize(models.llama(), Mesh(dp=2, cp=2), loss_fn=models.lm_loss, optimizer=models.adamw)
    pm.compile((torch.cat([IDS, IDS]),), {}, torch.cat([TARGET, TARGET]))
    code = pm.graph(3).code
    assert code.count("torch.ops.autopar.ring_attention.default(") == 2 and "'cp'" in code
    assert "scaled_dot_product_attention" not in code and "torch.ops.autopar.cp_positions.default(4, 'cp'" in code
    ring = [c for c in pm.plan.collectives if c.axis == "cp"]
    assert [(c.direction, c.count) for c in ring] == [("forward", 2), ("backward", 6)]
    assert "send_recv      on cp" in str(pm.plan)


@pytest.mark.slow  # three legs on up to 4 ranks, about 75 s
def test_checkpoints_move_between_cp_and_other_meshes(launcher, tmp_path) -> None:
    """LLaMA saved on dp=2 x cp=2, resumed on dp=2, then on cp=2: equal to one uninterrupted device."""
    from test_checkpoint_reshard import _assert_chain_equals_one_device

    _assert_chain_equals_one_device(launcher, str(tmp_path / "ckpt"), models.factory(models.llama),
                                    [(dict(dp=2, cp=2), 0, 2), (dict(dp=2), 0, 1), (dict(cp=2), 0, 1)])
