"""A rank job's own ``AUTOPAR_SOLVED_DIR``: set for the job only, as the worker runs the session's next jobs."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

from autopar.core.shared_dir import SOLVED_DIR


@contextlib.contextmanager
def shared_dir(folder: str) -> Iterator[None]:
    before = os.environ.get(SOLVED_DIR)
    os.environ[SOLVED_DIR] = folder
    try:
        yield
    finally:
        if before is None:
            del os.environ[SOLVED_DIR]
        else:
            os.environ[SOLVED_DIR] = before
