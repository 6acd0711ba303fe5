"""A process remembers exports only under a key that holds everything the export reads (autopar/compiler/export_key.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import models
from autopar.compiler.capture import capture
from autopar.compiler.capture_cache import EXPORTS
from autopar.compiler.export_key import export_key

IDS = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(0))


def key(model: torch.nn.Module, ids: torch.Tensor = IDS, loss=models.lm_loss) -> object:
    return export_key(model, ((ids,), {}, ids), loss, with_loss=True, output_dtype=None)


def test_a_rebuilt_identical_model_reuses_the_export_and_gets_a_graph_of_its_own() -> None:
    make = models.factory(models.gpt2, layers=1)
    first = capture(make(), (IDS,), with_loss=True, loss_fn=models.lm_loss, target=IDS)
    hits = EXPORTS.hits
    for node in first.gm.graph.nodes:  # a pass rewriting the first graph must not reach the remembered one
        node.meta["rewritten"] = True
    second = capture(make(), (IDS,), with_loss=True, loss_fn=models.lm_loss, target=IDS)
    assert EXPORTS.hits == hits + 1
    assert second.gm.code == first.gm.code and second.slots == first.slots
    assert second.gm is not first.gm and not any("rewritten" in n.meta for n in second.gm.graph.nodes)


def test_the_key_changes_with_whatever_can_change_the_graph() -> None:
    make = models.factory(models.bert, layers=1)
    base = key(make())
    assert base is not None and key(make()) == base  # parameter values are not read: fake during export
    evaluated = make().eval()
    other_config = make()
    other_config.config.hidden_act = "relu"
    frozen = make()
    frozen.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    changed = [key(evaluated), key(other_config), key(frozen), key(make(), IDS[:, :4]),
               key(make(), loss=lambda out, t: F.cross_entropy(out.logits.flatten(0, 1), t.flatten()))]
    assert all(k != base for k in changed) and len(set(map(hash, changed))) == len(changed)


def test_what_it_cannot_hold_exactly_is_not_remembered() -> None:
    hooked = models.factory(models.gpt2, layers=1)()
    hooked.register_forward_hook(lambda *args: None)
    assert key(hooked) is None
    odd = models.factory(models.gpt2, layers=1)()
    odd.transformer.extra = __import__("threading").Lock()  # an attribute of a type the key cannot fingerprint
    assert key(odd) is None
    odd = models.factory(models.gpt2, layers=1)()
    with FakeTensorMode():
        odd.transformer.extra = torch.zeros(2)  # a fake tensor left on the model by an export: not a value
    assert key(odd) is None


def test_a_tensor_attribute_is_keyed_by_its_value() -> None:
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    b.load_state_dict(a.state_dict())
    a.scale, b.scale = torch.tensor([1.0]), torch.tensor([2.0])  # plain tensors: constants of the graph
    x = torch.ones(1, 2)
    ka = export_key(a, ((x,), {}, None), None, with_loss=False, output_dtype=None)
    kb = export_key(b, ((x,), {}, None), None, with_loss=False, output_dtype=None)
    assert ka is not None and ka != kb


def test_a_training_export_answers_the_forward_only_one() -> None:
    """``pm(...)`` after ``pm.step`` exports nothing: the training export also gave the forward-only graph,
    equal to the one a forward-only export makes (here with BatchNorm's running statistics mutated)."""
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    target = torch.randint(0, 10, (4,))
    for make in (models.factory(models.gpt2, layers=1), models.cnn):
        inputs, loss, tgt = ((IDS,), models.lm_loss, IDS) if make is not models.cnn else ((x,), F.cross_entropy, target)
        EXPORTS.kept.clear()
        direct = capture(make(), inputs)
        EXPORTS.kept.clear()
        capture(make(), inputs, with_loss=True, loss_fn=loss, target=tgt)
        hits = EXPORTS.hits
        derived = capture(make(), inputs)
        assert EXPORTS.hits == hits + 1
        assert derived.gm.code == direct.gm.code and derived.slots == direct.slots
        assert derived.mutated_buffers == direct.mutated_buffers and derived.out_spec == direct.out_spec


def test_a_target_passed_as_the_input_itself_is_another_export() -> None:
    """The export of ``target=ids`` (the same tensor) has one placeholder for both, which the model reads: an
    export for a target of its own, same shapes, must not be that one."""
    make = models.factory(models.gpt2, layers=1)
    other = IDS.roll(1, dims=1)
    assert key(make()) != export_key(make(), ((IDS,), {}, other), models.lm_loss, with_loss=True, output_dtype=None)
    capture(make(), (IDS,), with_loss=True, loss_fn=models.lm_loss, target=IDS)
    apart = capture(make(), (IDS,), with_loss=True, loss_fn=models.lm_loss, target=other)
    inputs = [n for n, slot in zip(apart.gm.graph.nodes, apart.slots) if slot.kind.name == "INPUT"]
    assert len(inputs) == 2 and all(n.users for n in inputs)  # the ids and the target, each read


def test_the_key_holds_the_devices_index() -> None:
    """The export writes the device into the graph (``arange(..., device=cuda:0)``), and a model captured on cuda:1
    is moved from cuda:1 (``Program.move_to``): one on cuda:0 must not answer it. (Fake CUDA tensors: no GPU.)"""
    def on(device: str) -> object:
        model = torch.nn.Linear(2, 2)
        with FakeTensorMode():
            model.weight = torch.nn.Parameter(torch.empty(2, 2, device=device))
            x = torch.empty(1, 2, device=device)
        return export_key(model, ((x,), {}, None), None, with_loss=False, output_dtype=None)
    assert on("cuda:0") is not None and on("cuda:0") != on("cuda:1")


def test_a_loss_whose_closure_has_an_empty_cell_is_keyed() -> None:
    """A cell not yet assigned (a function the loss calls, defined after it) holds nothing: keyed as None."""
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return scale(F.mse_loss(out, target))
    x = torch.ones(1, 2)
    before = export_key(torch.nn.Linear(2, 2), ((x,), {}, x), loss, with_loss=True, output_dtype=None)

    def scale(v: torch.Tensor) -> torch.Tensor:
        return v
    assert before is not None and before != export_key(torch.nn.Linear(2, 2), ((x,), {}, x), loss, with_loss=True,
                                                       output_dtype=None)
