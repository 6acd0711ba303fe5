"""Debug logging of the compiler: ``AUTOPAR_DEBUG=1`` logs each pass, its node counts and its time."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Iterator

logger = logging.getLogger("autopar")


def debug_enabled() -> bool:
    """Whether the passes log: ``AUTOPAR_DEBUG=1`` adds a handler on stderr the first time a pass asks (nothing
    is installed at import); a logger the application configured itself is left as it is."""
    if os.environ.get("AUTOPAR_DEBUG", "") not in ("", "0") and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[autopar] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    return logger.isEnabledFor(logging.DEBUG)


@contextlib.contextmanager
def log_pass(name: str, nodes_before: int | None = None) -> Iterator[dict]:
    """Times a pass; the body may set ``info["nodes"]`` (after) and ``info["detail"]``."""
    info: dict = {}
    start = time.perf_counter()
    yield info
    if debug_enabled():
        before = "" if nodes_before is None else f"{nodes_before} -> "
        after = info.get("nodes", "?")
        detail = f"; {info['detail']}" if "detail" in info else ""
        logger.debug(f"{name}: {before}{after} nodes in {time.perf_counter() - start:.3f} s{detail}")
