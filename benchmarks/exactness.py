"""Float64 exactness of the test zoo: the worst relative error per parameter update, loss and output.

For every model of ``tests/models.py``'s zoo and every mesh below, trains two
AdamW steps in float64 on one device and on local gloo ranks, and prints the
worst relative error (``autopar.testing.relative_errors``). Models that compute
part of the step in float32 on purpose are measured, where the mesh splits the
batch, against the single-device run on the same split (the control); the
control's own error against the whole batch (the model's bound) is printed beside.

Run: python benchmarks/exactness.py [--models gpt2,llama] [--meshes dp2,tp2]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import models  # noqa: E402
from harness.exactness import MESHES, check  # noqa: E402
from autopar.runtime.launch import WorkerPool  # noqa: E402
from autopar.testing import Report  # noqa: E402

MODELS = ["gpt2", "llama", "bert", "phi3", "gemma2", "t5", "bart", "mamba", "fused_slice"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--meshes", default=",".join(MESHES))
    args = parser.parse_args()
    print(f"{'model':12s} {'mesh':10s} {'worst update error':>20s}  {'against':8s} {'model bound':>12s}  worst on")
    with WorkerPool(2) as pool:
        for name in args.models.split(","):
            for mesh in args.meshes.split(","):
                try:
                    r: Report = check(name, mesh, pool.launch, models.adamw)
                except AssertionError as e:
                    print(f"{name:12s} {mesh:10s} FAILED: {str(e).splitlines()[0][:150]}")
                    continue
                bound = f"{r.control_error:.1e}" if r.control_error is not None else "-"
                against = "control" if r.control_error is not None else "single"
                print(f"{name:12s} {mesh:10s} {r.update_error:20.1e}  {against:8s} {bound:>12s}  {r.worst}", flush=True)


if __name__ == "__main__":
    main()
