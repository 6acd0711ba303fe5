"""Exports as bytes (autopar/compiler/export_files.py): read back as they were written, and written once for the ranks of a
job that share ``AUTOPAR_SOLVED_DIR``."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.export.graph_signature import InputKind

import models
from autopar.compiler import capture as capture_module
from autopar.compiler.capture import _export, capture
from autopar.compiler.capture_cache import EXPORTS, Export
from autopar.compiler.export_key import export_key
from autopar.compiler.export_files import _autopar_files, decode, digest, encode
from harness.shared_dir import shared_dir


def _fresh(model: torch.nn.Module, ids: torch.Tensor) -> Export:
    return Export.of(_export(model, (ids,), {}, with_loss=True, loss_fn=models.lm_loss, target=ids,
                             output_dtype=None))


def _described(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype,
                value.device.type, value.requires_grad)
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, *map(_described, value)]
    return value


@pytest.mark.parametrize("make", [models.gpt2, models.llama, models.mixtral, models.bert])
def test_an_export_reads_back_as_it_was_written(make) -> None:
    model = make()
    ids = torch.randint(0, 90, (2, 8))
    fresh = _fresh(model, ids)
    data = encode(fresh)
    assert data is not None
    back = decode(data)
    assert back.graph_module.code == fresh.graph_module.code
    for a, b in zip(fresh.graph_module.graph.nodes, back.graph_module.graph.nodes, strict=True):
        assert (a.op, a.name, a.target) == (b.op, b.name, b.target)
        assert a.meta.keys() == b.meta.keys(), a.name
        assert {k: _described(v) for k, v in a.meta.items()} == {k: _described(v) for k, v in b.meta.items()}, a.name
    assert (back.input_specs, back.output_specs, back.out_spec) == (fresh.input_specs, fresh.output_specs,
                                                                    fresh.out_spec)
    # and it runs as the export does
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    inputs = [ids if s.kind == InputKind.USER_INPUT else fresh.constants[s.target]
              if s.kind == InputKind.CONSTANT_TENSOR else state[s.target.removeprefix("model.")]
              for s in fresh.input_specs]
    assert torch.equal(fresh.graph_module(*inputs)[0], back.graph_module(*inputs)[0])


def test_an_export_with_a_symbolic_size_is_not_written() -> None:
    class Rows(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(0)

    x = torch.randn(4, 3)
    ep = torch.export.export(Rows(), (x,), dynamic_shapes=({0: torch.export.Dim("rows")},), strict=False)
    assert encode(Export.of(ep)) is None


def test_a_key_names_classes_and_functions_by_their_code() -> None:
    def key(loss: object, model: torch.nn.Module | None = None) -> str | None:
        model = model or models.mlp((3, 4))
        return digest(export_key(model, ((torch.zeros(2, 3),), {}, torch.zeros(2, 4)), loss, with_loss=True,
                                 output_dtype=None))

    first, second = (lambda o, t: (o - t).mean()), (lambda o, t: (o + t).mean())
    assert key(first) == key(first) is not None
    assert key(first) != key(second)  # (one qualified name and line, two functions)
    assert key(first) != key(models.mse)
    assert key(first, models.fused_slice()) is not None  # (its code holds ``...`` and slices: shared too)
    held, other = models.mlp((3, 4, 4)), models.mlp((3, 4, 4))
    held.__dict__["other"], other.__dict__["other"] = held[0], other[1]  # (held outside ``_modules``)
    assert key(first, held) is not None and key(first, held) != key(first, other)  # named by their place
    outside = models.mlp((3, 4))
    outside.__dict__["other"] = models.mlp((3, 4))  # a module outside the model: its tensors would be constants
    assert key(first, outside) is None


def _rank_captures(folder: str, log: str) -> str:
    real = capture_module._export

    def noted(*args: object, **kwargs: object) -> object:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(*args, **kwargs)

    capture_module._export = noted
    EXPORTS.kept.clear()  # (a worker may have exported this model for an earlier test)
    try:
        with shared_dir(folder):
            ids = torch.arange(16).reshape(2, 8) % 90
            return capture(models.gpt2(), (ids,), with_loss=True, loss_fn=models.lm_loss, target=ids).gm.code
    finally:
        capture_module._export = real


def test_the_ranks_of_a_job_export_a_model_once(launcher, tmp_path: Path) -> None:
    log = tmp_path / "exports.txt"
    codes = launcher(_rank_captures, 3, str(tmp_path), str(log))
    assert len(log.read_text().split()) == 1  # one rank exported; the others read its bytes
    assert codes[0] == codes[1] == codes[2]


def test_the_digest_stamps_every_file_of_autopar_passes_and_runtime_included() -> None:
    """In a source checkout ``passes/`` and ``runtime/`` lie beside ``autopar/``: an export written by another
    version of ``passes/lazy_module.py`` must not be read."""
    import autopar.passes
    import autopar.runtime
    stamped = {name for name, *_ in _autopar_files()}
    for package in (autopar.passes, autopar.runtime):
        for root in map(Path, package.__path__):
            files = [str(p.relative_to(root.parent)) for p in root.rglob("*.py")]
            missing = [f for f in files if not any(s == f or s.endswith("/" + f) for s in stamped)]
            assert files and not missing, missing[:3]
