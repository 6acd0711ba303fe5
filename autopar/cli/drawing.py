"""The plan as a picture: which rank holds which shard of which layer.

``plan_grid`` computes, for every (pp, tp) position of the mesh (dp replicas
hold the same), which layers' parameters it holds and how: the whole tensor or
its tp shard. ``draw_plan`` renders that grid as a PNG (matplotlib).
"""
from __future__ import annotations

from pathlib import Path

from torch.distributed.tensor import Shard

from autopar.core.mesh import Mesh
from autopar.core.zero_layout import layer_of
from autopar.compiler.program import Program


def plan_grid(program: Program, mesh: Mesh) -> tuple[list[str], dict[tuple[int, int], dict[str, str]]]:
    """(layers in model order, {(pp, tp): {layer: "shard i/n" | "full" | "mixed i/n"}})."""
    names = list(program.param_of.values())
    layers = list(dict.fromkeys(layer_of(n) for n in names))
    grid: dict[tuple[int, int], dict[str, str]] = {}
    for pp in range(mesh.pp):
        for tp in range(mesh.tp):
            held = [n for st in program.own_stages(mesh.rank_of(pp=pp, tp=tp)) for n in st.params]
            cells: dict[str, set[bool]] = {}
            for n in held:
                cells.setdefault(layer_of(n), set()).add(isinstance(program.placements.get(n), Shard))
            grid[(pp, tp)] = {layer: (f"shard {tp + 1}/{mesh.tp}" if kinds == {True} else "full" if kinds == {False}
                                      else f"mixed {tp + 1}/{mesh.tp}") for layer, kinds in cells.items()}
    return layers, grid


def draw_plan(program: Program, mesh: Mesh, path: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("drawing the plan needs matplotlib: pip install 'autopar[plot]'") from e
    layers, grid = plan_grid(program, mesh)
    rows = sorted(grid)
    colors = ["#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd", "#dd8452", "#937860"]
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(layers) + 2), 0.5 * len(rows) + 2))
    for y, (pp, tp) in enumerate(rows):
        for x, layer in enumerate(layers):
            cell = grid[(pp, tp)].get(layer)
            if cell is None:
                continue
            shade = 1.0 if cell == "full" else 0.6
            ax.add_patch(plt.Rectangle((x, y), 0.95, 0.9, color=colors[pp % len(colors)], alpha=shade))
            ax.text(x + 0.47, y + 0.45, cell.replace("shard ", "").replace("mixed ", "~"), ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_xlim(0, len(layers))
    ax.set_ylim(len(rows), 0)
    ax.set_xticks([x + 0.47 for x in range(len(layers))], layers, rotation=70, ha="right", fontsize=6)
    ax.set_yticks([y + 0.45 for y in range(len(rows))], [f"pp {pp}, tp {tp}" for pp, tp in rows], fontsize=7)
    ax.set_title(f"{mesh}: layers held by each position\ncolour: pipeline stage; i/n: tp shard (~: partly sharded); "
                 f"each of the {mesh.dp} dp replicas holds the same", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
