"""A CPU model's tensors on huge pages.

A decode step streams every weight once. Through 4 KB pages, SmolLM2-135M's 270 MB of bfloat16
weights are 66,000 pages a step, each a translation the processor looks up; on 2 MB pages they are
135. Linux backs an anonymous mapping with 2 MB pages when its transparent huge pages are on
(`always`, or `madvise` for a mapping that asks: `madvise(MADV_HUGEPAGE)`), which torch's allocator
does not ask for unless `THP_MEM_ALLOC_ENABLE` is set before its first allocation. `rehome` moves a
module's tensors of a page or more, once, into one such mapping, whatever the process's environment.
On an Intel Xeon with AMX (2 cores) a 256 MB read went from 22-23 to 28-29 GB/s, and a bfloat16
SmolLM2 decode step from 17.2 to 14.9 ms (docs/performance.md).

`ModelConfig.huge_pages` chooses (auto: wherever the kernel offers them; off: never).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch
from torch import nn

SETTINGS = ("auto", "off")
HUGE_PAGE = 2 * 2**20
MIN_BYTES = 4096  # a page: smaller tensors (norms' weights) stay where they are
_ALIGN = 64  # each tensor's first byte: a cache line, as torch's allocator aligns
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this kernel backs an advised anonymous mapping with huge pages (`[always]` or `[madvise]`)."""
    try:
        mode = _THP.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in mode or "[madvise]" in mode)


def wanted(setting: str, device: str) -> bool:
    if setting not in SETTINGS:
        raise ValueError(f"huge_pages must be one of {SETTINGS}, not {setting!r}")
    return setting == "auto" and device == "cpu" and available()


def empty(nbytes: int) -> torch.Tensor:
    """`nbytes` uint8, uninitialised, from a 2 MB boundary of a fresh anonymous mapping advised for huge
    pages. The tensor keeps the mapping alive."""
    # Private: a shared anonymous mapping is shared memory, which takes huge pages only where
    # `shmem_enabled` says so (usually never).
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def rehome(module: nn.Module, min_bytes: int = MIN_BYTES, values: bool = True) -> int:
    """Moves `module`'s CPU parameters and buffers of at least `min_bytes` into one huge-page mapping
    (`empty`), in place: the same tensors (tied ones stay tied), new storage, holding the same values
    (`values`), or none yet (a model whose weights are about to be read in). Returns the bytes moved."""
    seen: set[int] = set()
    tensors = []
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type == "cpu" and t.nbytes >= min_bytes and t.is_contiguous() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            tensors.append(t)
    if not tensors:
        return 0
    sizes = [-(-t.nbytes // _ALIGN) * _ALIGN for t in tensors]
    arena = empty(sum(sizes))
    offset = 0
    with torch.no_grad():
        for t, size in zip(tensors, sizes, strict=True):
            home = arena[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
            if values:
                home.copy_(t)
            t.set_(home)
            offset += size
    return offset
