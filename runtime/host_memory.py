"""Freed host memory kept by the process: CPU ranks reuse warm pages instead of faulting in fresh ones.

glibc's allocator serves blocks above a threshold (128 KiB at start, raised as such blocks are freed) with
``mmap`` and returns them to the system when freed, and it trims the top of its heap once more than twice that
threshold is free there. A training step frees most of its activations and gradients and allocates them again
in the next microbatch, so on a CPU rank each of them may come back as fresh pages: a page fault and a zeroing
per 4 KiB, each time. A zero-bubble schedule keeps each microbatch's output gradients until its ``W``, so more
of the heap is in use at once, and the allocations of its ``B`` land beyond what the previous microbatch left
resident: measured on the demo's GPT-2 stage, 640 page faults per microbatch under zb-h1 and none under
1F1B, 10% of the split backward's time.

``keep_freed_memory()`` sets the two thresholds once per process (``mallopt``): blocks up to 32 MiB come from
the heap, and the heap keeps up to 2 GiB free at its top. The process's resident memory then stays at its
peak between steps, which a training job reaches every step anyway. Larger blocks (a big layer's weight
gradients) are still mapped per allocation; ``autopar.core.weight_grad.KeptGradients`` keeps those that W
writes. Set ``AUTOPAR_KEEP_FREED_MEMORY=0`` to leave the allocator as it is. Elsewhere than on glibc (macOS,
musl) nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV = "AUTOPAR_KEEP_FREED_MEMORY"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit systems)
TRIM_THRESHOLD = (1 << 31) - 1  # (mallopt takes an int)
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds for this process (once); whether they are set."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get(ENV, "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
