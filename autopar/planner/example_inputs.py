"""The small batch the planner captures a model with: the caller's, or one guessed from a Hugging Face model.

``model_inputs(model, args, kwargs, sequence=...)`` returns what
``profile_model`` exports the model with: the caller's example inputs moved
to the model's device, or, when none are given, inputs guessed from the model
(``guess_inputs``): token ids ``(2, 16)`` for a language model (and the same
decoder ids for an encoder-decoder such as T5), ``pixel_values`` of the
configured image size for an image model (ViT), ``use_cache=False`` where the
model's ``forward`` takes it (a key/value cache is not a training output).

Invariant: every tensor returned lives on the model's device, so a model on
the meta device is captured with meta inputs and never meets a CPU tensor.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils import _pytree as pytree

BATCH, SEQ = 2, 16  # the capture's batch and sequence sizes (export needs sizes >= 2 to keep them free)

_HOW = ("pass example_inputs=(x,) with the batch in dim 0 (and the sequence in dim 1), and example_kwargs={...} for "
        "keyword inputs, to autopar.plan / profile_model / parallelize(model, 'auto'); `autopar plan` takes a "
        "factory that returns (model, inputs)")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); the CPU for a model with neither."""
    first = next(iter(model.parameters()), None)
    if first is None:
        first = next(iter(model.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


def on_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with every tensor moved to ``device`` (a meta model is captured with meta inputs)."""
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x, tree)


def model_inputs(model: torch.nn.Module, args: tuple | None, kwargs: dict | None, *,
                 sequence: bool = True) -> tuple[tuple, dict]:
    """The inputs ``profile_model`` captures ``model`` with, on the model's device (see the module docstring)."""
    device = model_device(model)
    if args is None:
        guessed, extra = guess_inputs(model, sequence=sequence)
        return guessed, {**extra, **on_device(kwargs or {}, device)}
    kwargs = dict(kwargs or {})
    if _takes(model, "use_cache") and "use_cache" not in kwargs and _config(model, "use_cache"):
        kwargs["use_cache"] = False
    return on_device(tuple(args), device), on_device(kwargs, device)


def sequence_of(inputs: tuple | None, model: torch.nn.Module | None = None) -> bool:
    """Whether a model's inputs have a sequence dim 1: token ids (B, S) or hidden states (B, S, H).

    Images (B, C, H, W) have none. Without inputs: the model's guessed ones
    (an image model's pixel values have none; anything else has one).
    """
    first = next((a for a in inputs or () if isinstance(a, torch.Tensor)), None)
    if first is None:
        return inputs is None and getattr(model, "main_input_name", None) != "pixel_values"
    return first.dim() == 3 or (first.dim() == 2 and not first.is_floating_point())


def guess_inputs(model: torch.nn.Module, *, sequence: bool = True, batch: int = BATCH,
                 seq: int = SEQ) -> tuple[tuple, dict]:
    """Example inputs for a Hugging Face model (or a module with input embeddings), on its device.

    Raises a ``ValueError`` that says how to pass inputs when the model's
    inputs cannot be told from its class and config.
    """
    device = model_device(model)
    main = getattr(model, "main_input_name", None)
    if main == "pixel_values":
        return (_pixels(model, batch, device, sequence),), _flags(model)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is None or main not in (None, "input_ids"):
        what = f"its main input is {main!r}" if main else "it has no input embeddings and no Hugging Face main input"
        raise ValueError(f"cannot tell the inputs of {type(model).__name__}: {what}; {_HOW}")
    if not sequence:
        raise ValueError(f"{type(model).__name__} takes token ids (batch, sequence); plan it with seq_len=... "
                         f"or {_HOW}")
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)  # (B, S)
    kwargs = _flags(model)
    if _config(model, "is_encoder_decoder"):
        kwargs["decoder_input_ids"] = torch.zeros(batch, seq, dtype=torch.long, device=device)  # (B, S) as long
    return (ids,), kwargs


def _pixels(model: torch.nn.Module, batch: int, device: torch.device, sequence: bool) -> torch.Tensor:
    size, channels = _config(model, "image_size"), _config(model, "num_channels") or 3
    if sequence:
        raise ValueError(f"{type(model).__name__} takes pixel_values (batch, {channels}, H, W), which have no "
                         "sequence dim; plan it with seq_len=None (its patches are fixed by the image size)")
    if not isinstance(size, int):
        raise ValueError(f"cannot tell the image size of {type(model).__name__} (config.image_size={size!r}); "
                         f"{_HOW}")
    dtype = next(iter(model.parameters())).dtype
    return torch.zeros(batch, channels, size, size, dtype=dtype, device=device)  # (B, C, H, W)


def _flags(model: torch.nn.Module) -> dict:
    return {"use_cache": False} if _takes(model, "use_cache") else {}


def _takes(model: torch.nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _config(model: torch.nn.Module, name: str) -> Any:
    return getattr(getattr(model, "config", None), name, None)
