"""Command-line values read into autopar's own: a mesh written ``dp=2,tp=2``."""
from __future__ import annotations

from autopar.core.mesh import Mesh


def parse_mesh(text: str) -> Mesh:
    """``"dp=2,tp=2"`` -> ``Mesh(dp=2, tp=2)``."""
    try:
        sizes = {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise ValueError(f"cannot read mesh {text!r}; write it like dp=2,pp=2,tp=2") from None
    return Mesh(**sizes)
