"""The command line: inspect prints plans and rank graphs, errors are short, the demo runs, logs and pictures."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import models
from autopar import Mesh, parallelize
from autopar.cli import main
from autopar.cli.demo import zero_bubble_beside
from autopar.runtime.trace import chrome_trace, pipeline_part, save_gantt, save_gantts

TESTS = str(Path(__file__).parent)


def test_inspect_prints_the_plan_and_a_rank_graph(capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(TESTS)
    assert main(["inspect", "models:gpt2", "--mesh", "pp=2,tp=2", "--rank", "3"]) == 0
    out = capsys.readouterr().out
    assert "autopar plan for Mesh(pp=2, tp=2)" in out and "cuts before: transformer.h.1" in out
    assert "rank 3 runs:" in out
    assert any(line.startswith(">> ") and "torch.ops.autopar.all_reduce" in line for line in out.splitlines())


def test_inspect_diff_shows_the_inserted_collectives(capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(TESTS)
    assert main(["inspect", "models:llama", "--mesh", "tp=2", "--rank", "0", "--diff"]) == 0
    out = capsys.readouterr().out
    assert "--- captured" in out and "+++ rank 0" in out
    assert any(line.startswith("+") and "autopar.all_reduce" in line for line in out.splitlines())


def test_inspect_shows_zero_gathers_inside_a_pipeline_stage(capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(TESTS)
    assert main(["inspect", "models:gpt2", "--mesh", "dp=2,pp=2", "--zero", "3", "--rank", "3"]) == 0
    out = capsys.readouterr().out
    assert "zero=3: stored sharded over dp" in out and "largest on rank" in out
    gathers = [line for line in out.splitlines() if line.startswith(">> ") and "zero_all_gather.default(" in line]
    assert gathers and all("'dp', [1, 3]" in line for line in gathers)  # rank 3's dp group, its stage's layers


@pytest.mark.parametrize("argv, message", [
    (["inspect", "models:gpt2", "--mesh", "dp=0"], "mesh axis dp=0 must be an integer >= 1"),
    (["inspect", "nosuchmodule:f"], "cannot import 'nosuchmodule'"),
    (["inspect", "models:nosuch"], "module 'models' has no 'nosuch'"),
    (["inspect", "models:mlp_default"], "return (model, example_inputs)"),
])
def test_errors_are_one_readable_line(capsys, monkeypatch, argv: list[str], message: str) -> None:
    monkeypatch.syspath_prepend(TESTS)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 2


def test_debug_flag_shows_the_traceback(monkeypatch) -> None:
    monkeypatch.syspath_prepend(TESTS)
    with pytest.raises(ValueError, match="dp=0"):
        main(["inspect", "models:gpt2", "--mesh", "dp=0", "--debug"])


def test_demo_runs_from_the_command_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "autopar.cli", "demo", "--mesh", "pp=2", "--steps", "2",
                           "--layers", "2", "--width", "32", "--compare-width", "32", "--vocab", "96", "--seq", "16",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2/2  loss" in done.stdout and "single-device" in done.stdout
    trace = json.loads((tmp_path / "autopar-timeline.json").read_text())
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} >= {"0F0", "1B1"}
    # 1F1B beside zb-h1 on 2 pipeline ranks: each schedule's measured bubble beside the simulated one
    assert "1F1B beside the zero-bubble schedule zb-h1" in done.stdout
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if "bubble measured" in line}
    assert set(rows) == {"1f1b", "zb-h1"}, done.stdout
    for line in rows.values():
        measured = float(line.split("bubble measured")[1].split("%")[0]) / 100
        simulated = float(line.split("simulated")[1].split("%")[0]) / 100
        assert 0 <= measured < 1 and 0 < simulated < 1, line
    assert " W " in rows["zb-h1"] and " W " not in rows["1f1b"]  # the zero-bubble steps ran their weight gradients
    if "no PNG" not in done.stdout:
        assert (tmp_path / "autopar-zero-bubble.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("cores, changes, reason", [
    (2, {}, None),
    (8, {}, None),
    (1, {}, "one core: a pipeline's ranks would take turns on it, and no schedule could fill the other's waits"),
    (2, {"no_zero_bubble": True}, "--no-zero-bubble"),
])
def test_demo_compares_schedules_on_no_more_ranks_than_cores(monkeypatch, cores: int, changes: dict,
                                                             reason: str | None) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    args = argparse.Namespace(**{"no_zero_bubble": False, **changes})
    assert zero_bubble_beside(args) == reason


def test_debug_log_names_each_pass(monkeypatch, capsys) -> None:
    """``AUTOPAR_DEBUG=1`` alone puts each pass's line on stderr (the handler it installs is taken off after)."""
    import logging

    logger = logging.getLogger("autopar")
    handlers, level = list(logger.handlers), logger.level
    logger.handlers.clear()
    monkeypatch.setenv("AUTOPAR_DEBUG", "1")
    try:
        parallelize(models.gpt2(), Mesh(pp=2, tp=2), example_inputs=(torch.zeros(4, 8, dtype=torch.long),),
                    microbatches=2)
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
    err = capsys.readouterr().err
    for name in ["capture (torch.export)", "tensor parallel (solve + lower, tp=2): ", "pipeline cut (2 stages): "]:
        assert f"[autopar] {name}" in err
    assert " -> " in err and " nodes in " in err


def test_timeline_pictures(tmp_path: Path) -> None:
    timelines = {0: [("0F0", 0.0, 0.001), ("0SEND_F0", 0.001, 0.0011), ("0B0", 0.003, 0.005)],
                 1: [("1RECV_F0", 0.0, 0.0012), ("1F0", 0.0012, 0.002), ("1B0", 0.002, 0.003)]}
    trace = chrome_trace(timelines)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["tid"], e["name"], e["cat"]) for e in events][:2] == [(0, "0F0", "F"), (0, "0SEND_F0", "SEND_F")]
    assert events[2]["ts"] == pytest.approx(3000) and events[2]["dur"] == pytest.approx(2000)
    zb = {0: [("0F0", 0.0, 0.001), ("0B0", 0.002, 0.003), ("0W0", 0.003, 0.004), ("OPTIMIZER", 0.004, 0.005)]}
    assert pipeline_part(zb[0]) == zb[0][:3]
    pytest.importorskip("matplotlib")
    png = save_gantt(timelines, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    both = save_gantts({"1f1b": timelines, "zb-h1": zb}, tmp_path / "both.png")
    assert both.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compiling_prints_nothing(capsys) -> None:
    pm = parallelize(models.mlp((4, 2)), Mesh(dp=1), example_inputs=(torch.ones(2, 4, dtype=torch.float64),),
                     example_target=torch.ones(2, 2, dtype=torch.float64), loss_fn=models.mse, optimizer=models.sgd)
    assert pm.plan is not None
    assert capsys.readouterr().out == ""


def test_plan_grid_and_picture(tmp_path: Path) -> None:
    from autopar.cli.drawing import draw_plan, plan_grid

    ids = torch.zeros(4, 8, dtype=torch.long)
    pm = parallelize(models.gpt2(), Mesh(pp=2, tp=2), example_inputs=(ids,), microbatches=2)
    program = pm.compile((ids,), {}, None, with_loss=False)
    layers, grid = plan_grid(program, Mesh(pp=2, tp=2))
    assert layers[:3] == ["transformer.wte", "transformer.wpe", "transformer.h.0"]
    assert grid[(0, 1)]["transformer.wte"] == "shard 2/2" and grid[(1, 0)]["transformer.wte"] == "shard 1/2"  # tied
    assert "transformer.h.0" in grid[(0, 0)] and "transformer.h.0" not in grid[(1, 0)]
    assert grid[(1, 1)]["transformer.ln_f"] == "full"
    pytest.importorskip("matplotlib")
    assert draw_plan(program, Mesh(pp=2, tp=2), tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------
# autopar plan: a factory with arguments, cluster descriptions, bad options
# ---------------------------------------------------------------------------

def test_plan_takes_a_factory_with_literal_arguments(capsys) -> None:
    argv = ["plan", "autopar.planner:gpt(2, 64, 4, vocab=128, positions=64)", "--devices", "4", "--cluster",
            "dgx-h100", "--seq", "64", "--global-batch", "8", "--top", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "autopar plan: GPT (" in out and "on 4 x DGX-H100" in out and "- 2 layers; the largest" in out


def test_a_factorys_arguments_are_literals_never_evaluated() -> None:
    from autopar.cli import literal_call

    assert literal_call("gpt(128, 25600, 160, vocab=51200)", "s") == ((128, 25600, 160), {"vocab": 51200})
    assert literal_call("f((1, 2), name='x', on=True, size=-2.5e3)", "s") == (((1, 2),), {"name": "x", "on": True,
                                                                                        "size": -2500.0})
    for bad in ("gpt(__import__('os'))", "gpt(n)", "gpt(1 + 1j * x)", "gpt(*sizes)", "gpt(**opts)", "gpt(",
                "os.system('x')"):
        with pytest.raises(ValueError, match="literal|write the arguments out|cannot read the call|one call"):
            literal_call(bad, "spec")


@pytest.mark.parametrize("options, message", [
    (["--devices", "0"], "--devices 0: must be an integer >= 1 (devices of the job)"),
    (["--devices", "8", "--global-batch", "-4"], "--global-batch -4: must be an integer >= 1"),
    (["--devices", "8", "--set", "memory=0"], "memory=0 must be a number > 0 (bytes of memory a device offers"),
    (["--devices", "8", "--set", "peak_flops=0"], "peak_flops=0 must be a number > 0 (dense FLOP/s"),
    (["--devices", "8", "--set", "inter.bandwidth=-25e9"], "--set: inter.bandwidth=-25000000000.0 must be a number > 0"),
    (["--devices", "8", "--set", "intra.bandwidth=0"], "--set: intra.bandwidth=0 must be a number > 0"),
    (["--devices", "8", "--set", "devices_per_node=16"],
     "the cluster's node of devices_per_node=16 devices is larger than the job's --devices 8"),
    (["--devices", "8", "--set", "devices_per_node=0"], "devices_per_node=0 must be an integer >= 1"),
    (["--devices", "8", "--set", "memory=lots"], "--set 'memory=lots': 'lots' is not a number"),
    (["--devices", "8", "--set", "hbm=80e9"], "--set: unknown field hbm; the fields are name, devices_per_node"),
    (["--devices", "8", "--cluster", "dgx-b200"], "--cluster dgx-b200: not a preset (dgx-a100, dgx-h100, grand-teton-h100, cpu) nor a"),
])
def test_plan_errors_name_the_option_or_field_and_its_value(capsys, options: list[str], message: str) -> None:
    assert main(["plan", "autopar.planner:gpt3_175b", *options]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 2


def test_plan_reads_a_cluster_file_and_names_its_missing_figures(capsys, tmp_path: Path) -> None:
    node = {"name": "8 x B", "devices_per_node": 8, "memory": 40e9, "peak_flops": 300e12, "peak_flops_fp32": 20e12,
            "intra": {"bandwidth": 300e9, "latency": 5e-6}, "inter": {"bandwidth": 25e9, "latency": 1e-5}}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({k: v for k, v in node.items() if k != "peak_flops"}))
    assert main(["plan", "autopar.planner:gpt3_175b", "--devices", "64", "--cluster", str(path)]) == 1
    assert f"--cluster {path}: missing peak_flops (dense FLOP/s of a device's mixed-precision" in capsys.readouterr().err
    path.write_text(json.dumps({**node, "inter": {"bandwidth": 0, "latency": 1e-5}}))
    assert main(["plan", "autopar.planner:gpt3_175b", "--devices", "64", "--cluster", str(path)]) == 1
    assert f"--cluster {path}: inter.bandwidth=0 must be a number > 0" in capsys.readouterr().err
    path.write_text(json.dumps(node))
    argv = ["plan", "autopar.planner:gpt(2, 64, 4, vocab=128, positions=64)", "--devices", "16", "--cluster",
            str(path), "--seq", "64", "--global-batch", "16", "--top", "1"]
    assert main(argv) == 0
    assert "on 16 x 8 x B;" in capsys.readouterr().out
    assert main([*argv[:3], "4", *argv[4:]]) == 1  # a node of 8 described for a job of 4 devices
    assert "devices_per_node=8 devices is larger than the job's --devices 4" in capsys.readouterr().err


def test_the_demo_bounds_what_a_free_split_could_gain() -> None:
    """The demo's bound is ZB-H1's against 1F1B's step with B + W = 1F1B's B: 1 - 2 (p - 1) W / ((m + p - 1)(F + B))."""
    from autopar.cli.demo import free_split_bound

    rows = {"1f1b": (0.18, {"F": 7.8, "B": 10.7, "W": None}), "zb-h1": (0.19, {"F": 8.0, "B": 8.0, "W": 3.4})}
    w = 10.7 * 3.4 / 11.4
    expected = 1 - 2 * w / (9 * (7.8 + 10.7))
    text = free_split_bound(rows, 8)
    assert f"would be {expected:.3f} here" in text and "W 30% of it" in text
