"""Digests of plans and rank graphs: a refactor that must not change behaviour prints the same lines before and after.

Compiles nine configurations without a process group (GPT-2 dp2 and tp2, LLaMA tp2 with sequence parallelism,
GPT-2 pp2 zb-h1, LLaMA ZeRO-3, LLaMA dp2 x pp2 x tp2 mixed precision with recomputation, LLaMA cp2, Mixtral ep2,
LLaMA tp2 compiled), and plans a 24-layer GPT for 64 and 8 devices; writes each plan's text and every rank's
graph code to OUT/<name>.txt (seconds masked) and prints a digest per case. Compare two trees with
``diff -r``. Used for the move of the compile driver into ``autopar/compiler/`` (2026-12-06): all eleven equal.
Run: python benchmarks/plan_digest.py OUT
"""
import hashlib
import re
import sys
from pathlib import Path

import torch

import autopar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import models as M  # noqa: E402

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("plan-digest")
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
ids = torch.randint(0, 96, (4, 8))
tgt = torch.randint(0, 96, (4, 8))
cases = {
    "gpt2_dp2": (M.gpt2, autopar.Mesh(dp=2), {}),
    "gpt2_tp2": (M.gpt2, autopar.Mesh(tp=2), {}),
    "llama_tp2_sp": (M.llama, autopar.Mesh(tp=2), {"sequence_parallel": True}),
    "gpt2_pp2_zb": (M.gpt2, autopar.Mesh(pp=2), {"schedule": "zb-h1", "microbatches": 2}),
    "llama_zero3": (M.llama, autopar.Mesh(dp=2), {"zero": 3}),
    "llama_3d_mixed": (lambda: M.llama(dtype=torch.float32), autopar.Mesh(dp=2, pp=2, tp=2), {"zero": 1, "microbatches": 2, "precision": "mixed", "recompute": "selective"}),
    "llama_cp2": (M.llama, autopar.Mesh(dp=1, cp=2), {}),
    "mixtral_ep2": (M.mixtral, autopar.Mesh(dp=2, ep=2), {}),
    "llama_tp2_compiled": (M.llama, autopar.Mesh(tp=2), {"compile": True}),
}
for name, (make, mesh, kw) in cases.items():
    try:
        pm = autopar.parallelize(make(), mesh, loss_fn=M.lm_loss, optimizer=M.sgd, example_inputs=(ids,),
                                 example_target=tgt, **kw)
        text = [str(pm.plan)]
        for r in range(mesh.size):
            text.append(f"--- rank {r}\n" + pm.graph(r).code)
        body = "\n".join(text)
    except Exception as e:  # the same error before and after is also identical behaviour
        body = f"ERROR {type(e).__name__}: {e}"
    body = re.sub(r"\d+\.\d+ s\b", "<s>", body)  # compile seconds vary run to run
    (out / f"{name}.txt").write_text(body)
    print(name, hashlib.sha1(body.encode()).hexdigest()[:12], len(body))

from autopar.planner import plan  # noqa: E402

from autopar.planner.gpt import gpt
for name, kw in {"plan_gpt_64": dict(devices=64, global_batch=512, seq_len=2048), "plan_gpt_local": dict(devices=8, global_batch=64, seq_len=1024, top=5)}.items():
    r = plan(gpt(24, 2048, 16), **kw)
    body = re.sub(r"\d+\.\d+ s\b", "<s>", str(r) + "\n" + r.to_json().split('"seconds"')[0])
    (out / f"{name}.txt").write_text(body)
    print(name, hashlib.sha1(body.encode()).hexdigest()[:12], len(body))
