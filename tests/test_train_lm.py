"""examples/train_lm.py: its first 50 steps on dp=2 x tp=2 equal a plain single-device PyTorch run (float64)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("train_lm_script", ROOT / "examples" / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # (not registered as a module: the ranks receive its functions by value)
    return module


def test_fifty_steps_on_dp2_tp2_equal_one_device(launcher, tmp_path: Path) -> None:
    script = _script()
    small = ["--steps", "50", "--layers", "2", "--width", "32", "--heads", "4", "--kv-heads", "2", "--seq", "32",
             "--batch", "8", "--corpus-mb", "0.1", "--dtype", "float64", "--ckpt-every", "25", "--log-every", "50"]
    one = script.train(script.arguments([*small, "--mesh", "none", "--out", str(tmp_path / "one")]))
    args = script.arguments([*small, "--mesh", "dp=2,tp=2", "--out", str(tmp_path / "par")])
    runs = launcher(script.train, 4, args)
    assert len(one) == 50 and one[-1] < one[0] - 1.0  # it learns
    for losses in runs:
        worst = max(abs(a - b) / abs(a) for a, b in zip(one, losses))
        assert len(losses) == 50 and worst <= 1e-10, worst
    logged = (tmp_path / "par" / "metrics.csv").read_text().splitlines()
    assert logged[0] == "step,loss,tokens_per_s,mfu" and len(logged) == 51
    assert (tmp_path / "par" / "loss.png").stat().st_size > 0 and (tmp_path / "par" / "checkpoint").is_dir()
