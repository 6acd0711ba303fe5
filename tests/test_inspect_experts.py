"""``autopar inspect`` on a mixture of experts under ``Mesh(dp=2, ep=2)``: which experts each rank holds, and
the dispatch and combine collectives, in the plan and in a rank's graph."""
from __future__ import annotations

import re
from pathlib import Path

from autopar.cli import main

TESTS = str(Path(__file__).parent)
MODEL = "models:mixtral_eager(layers=1, aux=False)"


def test_inspect_shows_each_ranks_experts_and_the_all_to_alls(capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(TESTS)
    assert main(["inspect", MODEL, "--mesh", "dp=2,ep=2", "--rank", "1", "--microbatches", "1"]) == 0
    out = capsys.readouterr().out
    plan, graph = out.split("rank 1 runs:")
    assert "model.layers.0.mlp.experts (MixtralExperts): 4 experts, top-2; ranks [0]: experts 0-1; ranks [1]: " \
           "experts 2-3" in plan
    assert "Shard(0) over ep (E/ep=2 rows per ep index)" in plan
    assert re.search(r"all_to_all +on ep: 1 x", plan) and len(re.findall(r"all_to_all_v +on ep: 2 x", plan)) == 2
    marked = [line for line in graph.splitlines() if line.startswith(">> ") and "self.expert_parallel_0(" in line]
    assert len(marked) == 1 and "this rank's experts 2-3 of 4" in marked[0], graph[-2000:]
    assert "dispatch and combine all_to_all_v over ep" in marked[0]
