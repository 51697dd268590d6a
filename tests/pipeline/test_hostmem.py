"""Once blockpred has set glibc's thresholds, large arrays come from the heap (kept and reused), not from mmap."""

import platform
import subprocess
import sys

import pytest

SCRIPT = """
import ctypes, sys
import numpy as np

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
if sys.argv[1] == "set":
    from blockpred.pipeline.hostmem import keep_freed_memory
    assert keep_freed_memory()
a = np.ones(64 * 2**20 // 8)  # 64 MiB: above glibc's mmap threshold (at most 32 MiB by its own rule)
print(libc.mallinfo2().hblkhd)  # bytes in mmap'd blocks: unmapped (and faulted in anew) when freed
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_a_large_array_comes_from_the_heap_once_the_thresholds_are_set():
    def mmapped(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    assert mmapped("default") >= 64 * 2**20  # glibc's default: fresh pages from the kernel for every such array
    assert mmapped("set") < 2**20  # blockpred's: the heap, whose freed memory the next pass reuses


HUGEPAGE_SCRIPT = """
import sys
import numpy as np
multiarray = getattr(getattr(np, "_core", None), "multiarray", None) or np.core.multiarray
if sys.argv[1] == "set":
    from blockpred.pipeline.hostmem import keep_freed_memory
    keep_freed_memory()
print(multiarray._set_madvise_hugepage(True))  # the setting it had
"""


@pytest.mark.skipif(platform.system() != "Linux", reason="numpy asks for huge pages on Linux only")
def test_numpys_large_arrays_ask_for_no_huge_pages_once_blockpred_has_set_the_host_memory():
    def asks(mode: str) -> str:
        out = subprocess.run([sys.executable, "-c", HUGEPAGE_SCRIPT, mode], capture_output=True, text=True, check=True)
        return out.stdout.strip()

    assert asks("default") == "True"  # numpy's own: madvise(MADV_HUGEPAGE) for arrays of 4 MiB and more
    assert asks("set") == "False"
