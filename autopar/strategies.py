"""Hypothesis strategies for property tests of a user's own model: meshes, schedules, ZeRO and options.

``autopar.testing.strategies`` is this module (hypothesis is a test dependency,
imported only here)::

    from hypothesis import given, settings
    import autopar

    @settings(max_examples=20, deadline=None)
    @given(config=autopar.testing.strategies.configs(world=4, batch_size=8, max_stages=4))
    def test_my_model(config):
        autopar.testing.assert_equivalent(make_model, config.mesh, (ids,), target, loss_fn, make_optimizer,
                                          **config.options)

Every drawn configuration is one ``parallelize`` accepts for that world size:
the mesh's axes multiply to ``world``, the microbatches divide each dp rank's
batch, the schedule's stages fit ``max_stages`` (the model's layers) and its
rules (interleaved 1F1B: microbatches a multiple of pp; DualPipeV: at least
2 * pp - 1), ZeRO only with dp > 1, sequence parallelism only with tp > 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from autopar.core.mesh import Mesh
from autopar.core.schedules import SCHEDULES, STAGES_PER_RANK

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Config:
    """A mesh and the ``parallelize`` keyword arguments that go with it."""

    mesh: Mesh
    options: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"Config({self.mesh}{', ' if opts else ''}{opts})"


def meshes(world: int, axes: tuple[str, ...] = ("dp", "pp", "tp"), max_pp: int | None = None,
           batch_size: int | None = None) -> st.SearchStrategy[Mesh]:
    """A mesh over ``axes`` (in that order) whose sizes multiply to ``world``; pp at most ``max_pp``; dp a
    divisor of ``batch_size``."""
    found = []
    for sizes in _factorizations(world, len(axes)):
        mesh = dict(zip(axes, sizes))
        if max_pp is not None and mesh.get("pp", 1) > max_pp:
            continue
        if batch_size is not None and batch_size % mesh.get("dp", 1):
            continue
        found.append(Mesh(**mesh))
    if not found:
        raise ValueError(f"no mesh over {axes} has {world} ranks with pp <= {max_pp} and dp dividing the batch "
                         f"{batch_size}")
    return st.sampled_from(found)


@st.composite
def schedules(draw: Any, pp: int, rows: int | None = None, max_stages: int | None = None) -> dict[str, Any]:
    """A pipeline schedule for ``pp`` ranks with microbatches that divide ``rows`` (each dp rank's batch) and
    stages that fit ``max_stages``: ``{"schedule": ..., "microbatches": ..., ["stages_per_rank": ...]}``."""
    microbatches = [m for m in _divisors(rows) if m <= 8] if rows is not None else [1, 2, 4]
    if pp == 1:
        return {"microbatches": draw(st.sampled_from(microbatches))}
    names = [name for name in SCHEDULES if max_stages is None or pp * STAGES_PER_RANK.get(name, 1) <= max_stages]
    if max_stages is not None and 2 * pp > max_stages:
        names.remove("interleaved-1f1b")
    name = draw(st.sampled_from(names))
    allowed = [m for m in microbatches if name != "interleaved-1f1b" or m % pp == 0]
    allowed = [m for m in allowed if name != "dualpipev" or m >= 2 * pp - 1]
    if not allowed:  # (no microbatch count fits this schedule and batch: fall back to 1F1B)
        name, allowed = "1f1b", microbatches
    return {"schedule": name, "microbatches": draw(st.sampled_from(allowed))}


@st.composite
def configs(draw: Any, world: int, batch_size: int | None = None, max_stages: int | None = None,
            zero: tuple[int, ...] = (0, 1, 2, 3), precision: tuple[str, ...] = ("fp32",),
            recompute: tuple[str, ...] = RECOMPUTE, sequence_parallel: bool = True,
            axes: tuple[str, ...] = ("dp", "pp", "tp")) -> Config:
    """A whole configuration for ``world`` ranks (see the module doc); ``batch_size`` is the global batch."""
    mesh = draw(meshes(world, axes, max_pp=max_stages, batch_size=batch_size))
    rows = batch_size // mesh.dp if batch_size is not None else None
    options = dict(draw(schedules(mesh.pp, rows, max_stages)))
    options["zero"] = draw(st.sampled_from(zero)) if mesh.dp > 1 else 0
    options["precision"] = draw(st.sampled_from(precision))
    options["recompute"] = draw(st.sampled_from(recompute))
    if mesh.tp > 1 and sequence_parallel:
        options["sequence_parallel"] = draw(st.booleans())
    return Config(mesh, options)


def _factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every ``k``-tuple of positive integers whose product is ``n``."""
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in _divisors(n) for rest in _factorizations(n // d, k - 1)]


def _divisors(n: int | None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n else [1]
