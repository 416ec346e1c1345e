"""Process-level settings that make torch on CPU faster: the C allocator's thresholds.

glibc's malloc serves every allocation above ``M_MMAP_THRESHOLD`` with a fresh ``mmap`` and gives
it back to the kernel on free, so a training step that allocates the same [tokens, hidden]
activations layer after layer takes a page fault for every 4 KiB it touches, again each step.
In a virtual machine a page fault is expensive: measured with bench/trainer.py's model (8 runs x
4 x 128 tokens, forward+backward, 1 thread), the multi-adapter step ran 1.25 s with glibc's
defaults and 1.05 s with the thresholds below, the bare base model 0.90 s and 0.87 s. This is the
same trade that the tcmalloc and jemalloc preloads recommended for PyTorch on CPU make: freed
memory stays in the process for reuse, so the resident size stays at its high-water mark instead
of dropping between steps.

``tune_allocator`` raises the mmap threshold to its maximum (32 MiB on 64-bit glibc) and stops
the heap from being trimmed. It does nothing where the C library is not glibc, and nothing when
``PLEXRL_MALLOC_TUNING=0`` or when the variables ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` already say what the operator wants.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from services.config import process_settings

__all__ = ["tune_allocator"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2)
_TRIM_THRESHOLD = 2**31 - 1  # the largest an int takes: never trim in practice

_tuned: bool | None = None


def tune_allocator() -> bool:
    """Keep freed memory for reuse (see the module docstring); True when the setting took."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if not process_settings().malloc_tuning:  # PLEXRL_MALLOC_TUNING
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  (glibc only; musl has no such symbol)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
    return _tuned
