"""Deferred weight gradients over several microbatches: the fused accumulation, with and without hooks."""
from __future__ import annotations

import contextlib
import weakref

import pytest
import torch

from autopar.core.weight_grad import KeptGradients, collect, split_addmm, split_linear


def _microbatches(split: bool, w: torch.Tensor, b: torch.Tensor, xs: list[torch.Tensor], linear: bool) -> None:
    for x in xs:
        if not split:
            y = torch.nn.functional.linear(x, w, b) if linear else torch.addmm(b, x, w)
            (y.tanh() ** 2).sum().backward()
            continue
        with collect() as deferred:
            y = split_linear(x, w, b) if linear else split_addmm(b, x, w)
            (y.tanh() ** 2).sum().backward()
        deferred.run()  # W: the first lands through autograd, the next ones with addmm_ into .grad


@pytest.mark.parametrize("linear", [True, False])
def test_weight_gradients_accumulate_over_microbatches(linear: bool) -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 5, 4, generator=g, dtype=torch.float64) if linear else
          torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    shape = (6, 4) if linear else (4, 6)
    grads = []
    for split in (False, True):
        w = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
        b = torch.randn(6, generator=torch.Generator().manual_seed(2), dtype=torch.float64, requires_grad=True)
        _microbatches(split, w, b, xs, linear)
        grads.append((w.grad, b.grad))
    for native, deferred in zip(*grads):
        torch.testing.assert_close(deferred, native, rtol=1e-13, atol=1e-13)


def test_a_hooked_weight_fires_its_hook_after_each_accumulation() -> None:
    """Each W of a weight with a post-accumulate-grad hook calls the hook once, after adding its microbatch's
    gradient (the first W through autograd, the next ones with addmm_ and the hook called directly)."""
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    in_w: list[bool] = [False]
    seen: list[torch.Tensor] = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()) if in_w[0] else None)
    expected = torch.zeros_like(w)
    for x in [torch.randn(2, 4, dtype=torch.float64) for _ in range(3)]:
        with collect() as deferred:
            split_linear(x, w).sum().backward()
        in_w[0] = True
        deferred.run()
        in_w[0] = False
        expected += torch.ones(2, 6, dtype=torch.float64).t() @ x
        torch.testing.assert_close(seen[-1], expected)
    assert len(seen) == 3


@pytest.mark.parametrize("hook", ["post_accumulate", "tensor"])
def test_hooked_weights_get_what_one_backward_gives(hook: str) -> None:
    """Over microbatches, a deferred hooked weight's gradient and its hooks' calls in ``W`` match undeferred
    backwards: a post-accumulate hook that replaces ``.grad`` (as data-parallel sync makes it a bucket's view)
    and a tensor hook that scales the gradient (which only autograd's accumulation applies). In ``B`` the
    hooks see no gradient of the weight's own and are ignored here (the runtime disarms them there)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    results = []
    for split in (False, True):
        w = torch.randn(6, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
        calls: list[torch.Tensor] = []
        armed = [not split]
        if hook == "tensor":
            w.register_hook(lambda grad: 2 * grad if armed[0] else grad)
        else:
            def move(p: torch.Tensor) -> None:
                if armed[0]:
                    calls.append(p.grad.clone())
                    p.grad = p.grad.clone()
            w.register_post_accumulate_grad_hook(move)
        for x in xs:
            with collect() if split else contextlib.nullcontext() as deferred:
                (split_linear(x, w).tanh() ** 2).sum().backward()
            if deferred is not None:
                armed[0] = True
                deferred.run()
                armed[0] = False
        results.append((w.grad, calls))
    (native, native_calls), (deferred, deferred_calls) = results
    torch.testing.assert_close(deferred, native, rtol=1e-13, atol=1e-13)
    assert len(deferred_calls) == len(native_calls) == (3 if hook == "post_accumulate" else 0)
    for got, want in zip(deferred_calls, native_calls):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def _w_of_steps(w: torch.Tensor, xs: list[torch.Tensor], kept: KeptGradients | None, hold: list | None = None,
                view: bool = False, prepare: bool = False) -> list[torch.Tensor]:
    """Steps of one deferred microbatch each, the gradient freed after each step (``zero_grad(set_to_none=True)``);
    returns the gradient tensor each step's ``W`` made, or what ``hold`` keeps of it. ``prepare``: the kept
    gradients are zeroed before each step's backward (as the executor does at the step's first receive)."""
    made = []
    for x in xs:
        if prepare and kept is not None:
            kept.prepare()
        with collect() as deferred:
            (split_linear(x, w).tanh() ** 2).sum().backward()
        deferred.run(kept)
        made.append(w.grad.clone())
        if hold is not None:
            hold.append(w.grad[0] if view else w.grad)

        def free() -> None:
            w.grad = None
        kept.through(free) if kept is not None else free()
    return made


@pytest.mark.parametrize("prepare", [False, True])
def test_kept_gradients_are_written_in_place_with_the_same_numbers(prepare: bool) -> None:
    """The next step's first ``W`` writes the weight gradient into last step's tensor (resident memory) and gets
    bitwise the gradient autograd's accumulation gives; ``.grad`` is None between steps, as torch leaves it."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    grads = []
    for kept in (None, KeptGradients()):
        w = torch.randn(6, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
        storages: list[int] = []
        w.register_post_accumulate_grad_hook(lambda p: storages.append(p.grad.data_ptr()) if p.grad is not None else None)
        grads.append(_w_of_steps(w, xs, kept, prepare=prepare))
        assert w.grad is None
        if kept is not None:
            assert len(kept) == 1 and len(set(storages)) == 1  # one tensor, three steps
    for native, in_place in zip(*grads):
        assert torch.equal(native, in_place)


@pytest.mark.parametrize("prepare", [False, True])
@pytest.mark.parametrize("view", [False, True])
def test_a_gradient_someone_holds_is_not_overwritten(view: bool, prepare: bool) -> None:
    """A gradient tensor referred to after the step (kept by the caller, or viewed, as a data-parallel bucket's
    slot is) is left as it was: the next ``W`` takes autograd's new tensor."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(2)]
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
    held: list[torch.Tensor] = []
    kept = KeptGradients()
    made = _w_of_steps(w, xs, kept, held, view, prepare)
    first = made[0][0] if view else made[0]
    assert torch.equal(held[0], first) and not torch.equal(made[1], made[0])
    assert held[0].data_ptr() != held[1].data_ptr()


def test_prepare_zeroes_the_kept_gradients_ahead_of_w() -> None:
    """``prepare`` (run while a receive waits) zeroes the kept tensors, so the first ``W`` only adds into them;
    a tensor held elsewhere is dropped, not zeroed."""
    x = torch.randn(5, 4, dtype=torch.float64)
    w, v = (torch.randn(6, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    kept = KeptGradients()
    with collect() as deferred:
        (split_linear(x, w) + split_linear(x, v)).sum().backward()
    deferred.run(kept)
    mine, held = weakref.ref(w.grad), v.grad
    before = held.clone()

    def free() -> None:
        w.grad = v.grad = None
    kept.through(free)
    kept.prepare()
    assert len(kept) == 1 and mine() is not None and not mine().any()
    assert torch.equal(held, before)


def test_a_gradient_made_before_w_drops_the_kept_one() -> None:
    """A weight whose gradient something else makes before ``W`` (a use outside the split matmuls, run in B)
    gets no kept tensor: holding last step's would only hold its memory twice."""
    x = torch.randn(5, 4, dtype=torch.float64)
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    kept = KeptGradients()
    for step in range(3):
        with collect() as deferred:
            y = split_linear(x, w).sum()
            (y + (w.sum() if step > 0 else 0)).backward()  # from step 1 on, B makes w's gradient first
        if step == 1:
            assert id(w) in kept and w.grad is not None
        deferred.run(kept)
        if step > 0:
            assert id(w) not in kept and len(kept) == 0

        def free() -> None:
            w.grad = None
        kept.through(free)
        assert len(kept) == (1 if step == 0 else 0)


def test_the_deferred_input_is_saved_through_the_active_saved_tensor_hooks() -> None:
    """A split matmul keeps its input for W as autograd keeps saved tensors: packed by the hooks active in
    forward (sequence parallelism's regather, ZeRO-3's handles, recomputation), unpacked in backward."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    packed, unpacked = [], []

    def pack(t: torch.Tensor) -> tuple:
        packed.append(t)
        return ("box", t)

    def unpack(box: tuple) -> torch.Tensor:
        unpacked.append(box[1])
        return box[1]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = split_linear(x, w)
    assert any(t is x for t in packed)
    with collect() as deferred:
        (y ** 2).sum().backward()
    assert any(t is x for t in unpacked) and w.grad is None  # (W not yet run)
    deferred.run()
    expected = 2 * (x @ w.t()).t() @ x
    assert torch.allclose(w.grad, expected) and torch.allclose(x.grad, 2 * (x @ w.t()) @ w)


def test_a_weight_whose_output_needs_no_other_gradient_still_gets_its_own() -> None:
    """No input or bias gradient: the output is differentiable only through the weight, still deferred."""
    x = torch.randn(6, 4, dtype=torch.float64)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    with collect() as deferred:
        split_linear(x, w).sum().backward()
    deferred.run()
    assert torch.allclose(w.grad, torch.ones(6, 5, dtype=torch.float64).t() @ x)
