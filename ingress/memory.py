"""Give the memory of bodies read back to the system once they are freed.

The chunks of a body being read are up to uvicorn's read-ahead (64 KiB)
each. glibc's malloc maps blocks that large on their own at first, but raises
that threshold each time one is freed, and from then on serves them from its
heap, which it returns to the system only from the top: after many slow
bodies at once, the process keeps their memory for good. A fixed threshold
(mallopt(3): setting it turns the raising off) keeps them mapped on their
own, and each is returned when freed.
"""

from __future__ import annotations

import ctypes
import sys

#: Bytes from which each allocation is mapped on its own: uvicorn's read-ahead.
MMAP_THRESHOLD = 64 * 1024
#: mallopt's parameter number for it, from glibc's <malloc.h>.
M_MMAP_THRESHOLD = -3


def map_large_blocks_apart() -> bool:
    """Set glibc's mmap threshold to MMAP_THRESHOLD; False under another C library."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # 1 on success; musl's mallopt does nothing and answers 0.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
