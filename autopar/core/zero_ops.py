"""The stage-3 graph ops ``torch.ops.autopar.zero_*``: their schemas and shapes.

``passes.zero_graphs.insert_gathers`` writes these ops into graphs; ``runtime.zero_kernels``
runs them (each rank's flat shards and process groups live there) and gives
``zero_all_gather`` its backward, which reduce-scatters the layer's gradient
through the runtime's reduce queue. Declaring them here lets a pass build, print
and shape-propagate a stage-3 graph without the runtime.

| op                                         | forward                                                      |
|--------------------------------------------|--------------------------------------------------------------|
| zero_begin(prefetch)                       | starts a forward run (saved gathered tensors become handles) |
| zero_end()                                 | ends it                                                      |
| zero_all_gather(shard, axis, ranks, dtype) | the layer's full flat parameters (in ``dtype`` when given)   |
| zero_prefetch(shard, axis, ranks, dtype)   | starts that all-gather early                                 |
| zero_free(full, pieces)                    | releases a gathered layer after its last forward use         |

Mixed precision passes ``dtype=torch.bfloat16``: the fp32 shard is cast, and the bf16 copies gathered.
"""
from __future__ import annotations

import torch

SCHEMAS = {
    "zero_begin": "(SymInt prefetch=1) -> ()",
    "zero_end": "() -> ()",
    "zero_all_gather": "(Tensor shard, str axis, SymInt[] ranks, ScalarType? dtype=None) -> Tensor",
    "zero_free": "(Tensor full, Tensor[] pieces) -> ()",
    "zero_prefetch": "(Tensor shard, str axis, SymInt[] ranks, ScalarType? dtype=None) -> ()",
}

_LIB = torch.library.Library("autopar", "FRAGMENT")  # noqa: TOR901 (kept alive as long as the module)
for _name, _schema in SCHEMAS.items():
    _LIB.define(_name + _schema)


@torch.library.register_fake("autopar::zero_all_gather", lib=_LIB)
def _(shard: torch.Tensor, axis: str, ranks: list[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    return shard.new_empty(shard.shape[0] * len(ranks), dtype=dtype or shard.dtype)
