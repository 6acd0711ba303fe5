"""Debug logging of the compiler: ``AUTOPAR_DEBUG=1`` logs each pass, its node counts and its time."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Iterator

logger = logging.getLogger("autopar")
if os.environ.get("AUTOPAR_DEBUG", "") not in ("", "0") and not logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[autopar] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.DEBUG)


@contextlib.contextmanager
def log_pass(name: str, nodes_before: int | None = None) -> Iterator[dict]:
    """Times a pass; the body may set ``info["nodes"]`` (after) and ``info["detail"]``."""
    info: dict = {}
    start = time.perf_counter()
    yield info
    if logger.isEnabledFor(logging.DEBUG):
        before = "" if nodes_before is None else f"{nodes_before} -> "
        after = info.get("nodes", "?")
        detail = f"; {info['detail']}" if "detail" in info else ""
        logger.debug(f"{name}: {before}{after} nodes in {time.perf_counter() - start:.3f} s{detail}")
