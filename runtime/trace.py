"""Pipeline timelines as pictures: Chrome-trace JSON (opens in Perfetto) and a PNG Gantt chart.

A timeline is, per rank, the ``(action, start, end)`` records of
``runtime.step_executor.Executor.timeline`` (perf_counter seconds): the pipeline's
actions and the step's own (gradient reduction, optimizer, broadcasts). Ranks'
clocks are the same machine's clock for local ranks; times are shown relative to
the earliest start.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autopar.core.schedule import COMM_KINDS, COMPUTE_KINDS, RANK_KINDS, STAGE_KINDS, Action

Timeline = list[tuple[str, float, float]]
STEP_COLOR = "#8172b3"
COLORS = {"F": "#4c72b0", "B": "#55a868", "W": "#64b5cd", "SEND_F": "#dd8452", "RECV_F": "#8c8c8c",
          "SEND_B": "#dd8452", "RECV_B": "#8c8c8c", **dict.fromkeys(STAGE_KINDS + RANK_KINDS, STEP_COLOR)}


def kind(action: str) -> str:
    try:
        return Action.parse(action).kind
    except ValueError:
        return action


def pipeline_part(timeline: Timeline) -> Timeline:
    """The pipeline's actions of ``timeline`` (compute, sends, receives), without the step's own actions."""
    return [r for r in timeline if kind(r[0]) in COMPUTE_KINDS + COMM_KINDS]


def chrome_trace(timelines: dict[int, Timeline]) -> dict:
    """Chrome trace events: one thread per rank, one complete event per action (microseconds)."""
    t0 = min((s for tl in timelines.values() for _, s, _ in tl), default=0.0)
    events = []
    for rank, tl in sorted(timelines.items()):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        for action, start, end in tl:
            events.append({"name": action, "cat": kind(action), "ph": "X", "pid": 0, "tid": rank,
                           "ts": (start - t0) * 1e6, "dur": max(end - start, 0.0) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_chrome_trace(timelines: dict[int, Timeline], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(timelines)))
    return path


def save_gantt(timelines: dict[int, Timeline], path: str | Path, title: str = "pipeline timeline") -> Path:
    """A PNG Gantt chart: a row per rank; forward, backward, weight-gradient, send, receive and step-action bars
    (a receive blocks, so its bar includes the wait for the peer); gaps are idle time (the rank runs no action)."""
    return save_gantts({title: timelines}, path)


def save_gantts(panels: dict[str, dict[int, Timeline]], path: str | Path) -> Path:
    """`save_gantt`'s chart for each of ``panels`` (title -> timelines), one above the other on one time scale
    (each panel's times relative to its own earliest start), e.g. the same step under two schedules."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("drawing the timeline needs matplotlib: pip install 'autopar[plot]'") from e
    heights = [0.6 * len(timelines) + 0.9 for timelines in panels.values()]
    legend = 0.7  # inches below the panels
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, sum(heights) + legend), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    longest = max((span(timelines) for timelines in panels.values()), default=0.0)
    for ax, (title, timelines) in zip(axes[:, 0], panels.items()):
        _draw(ax, timelines, min_label=longest / 40)
        ax.set_title(title)
    ax.set_xlabel("time (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in ("F", "B", "W", "SEND_F", "RECV_F", "OPTIMIZER")]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="#8c8c8c", linewidth=0.5))
    fig.legend(handles, ["forward", "backward (input gradients only, when W is split off)", "weight gradients (W)",
                         "send", "receive (waiting for the peer)", "gradient reduction, optimizer, broadcasts", "idle"],
               loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, legend / (sum(heights) + legend), 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def span(timelines: dict[int, Timeline]) -> float:
    """Seconds from the first start to the last end over all ranks."""
    records = [r for tl in timelines.values() for r in tl]
    return max(e for _, _, e in records) - min(s for _, s, _ in records) if records else 0.0


def _draw(ax: Any, timelines: dict[int, Timeline], min_label: float) -> None:
    """The bars of ``timelines`` on ``ax``, compute bars at least ``min_label`` seconds long labelled."""
    t0 = min((s for tl in timelines.values() for _, s, _ in tl), default=0.0)
    ranks = sorted(timelines)
    for row, rank in enumerate(ranks):
        for action, start, end in timelines[rank]:
            k = kind(action)
            ax.barh(row, (end - start) * 1e3, left=(start - t0) * 1e3, color=COLORS.get(k, "#dd8452"),
                    edgecolor="white", linewidth=0.3)
            if k in ("F", "B", "W") and end - start >= min_label and end > start:
                ax.text((start - t0 + (end - start) / 2) * 1e3, row, action, ha="center", va="center",
                        fontsize=6, color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
