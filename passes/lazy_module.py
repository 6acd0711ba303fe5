"""Graph modules that generate their Python code when first run or read, not at each ``recompile()``.

A compile rewrites its graphs pass after pass, each pass ending with ``recompile()``, and it builds the graphs of
every rank (each tp index, each pipeline stage) though a rank runs only its own: generating and ``exec``-ing the
code each time was a fifth of some compiles. torch's ``_LazyGraphModule`` marks the code stale instead and
generates it on the first call or the first read of ``.code``; its copies are lazy too. Where torch lacks it,
these are the plain ``GraphModule`` and the plain export.
"""
from __future__ import annotations

import contextlib

import torch.fx as fx

try:
    from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
except ImportError:  # pragma: no cover - a torch without it
    _LazyGraphModule = None


def graph_module(root: fx.GraphModule | dict, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)``, generating its code when first needed."""
    return fx.GraphModule(root, graph) if _LazyGraphModule is None else _LazyGraphModule(root, graph)


def lazy(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``'s graph in a module that generates its code when first needed (``gm`` gives the graph up)."""
    return gm if _LazyGraphModule is None else _LazyGraphModule.from_graphmodule(gm)


def lazy_exports() -> contextlib.AbstractContextManager:
    """Within it, the graph modules torch.export builds generate their code when first needed."""
    return contextlib.nullcontext() if _LazyGraphModule is None else _use_lazy_graph_module(True)
