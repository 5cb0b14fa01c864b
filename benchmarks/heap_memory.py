"""Peak heap memory of the benchmark process, shared by the overhead benchmarks (no
framework imported: the PyTorch and MindSpore benchmarks both use it)."""

import ctypes
import os
import threading
import time
from typing import Callable, Optional


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def allocated_bytes_reader() -> Callable[[], int]:
    """Bytes the C heap has handed out (glibc mallinfo2: small blocks + mmapped blocks),
    which, unlike RSS, drops as soon as memory is freed; RSS where it is unavailable.
    (MindSpore's CPU memory statistics, ``ms.runtime.max_memory_allocated``, stay at 0 on
    the CPU; on a GPU use torch.cuda.max_memory_allocated instead.)"""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2

        def allocated() -> int:
            info = libc.mallinfo2()
            return info.uordblks + info.hblkhd

        allocated()
        return allocated
    except (OSError, AttributeError):
        page = os.sysconf("SC_PAGE_SIZE")

        def rss() -> int:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * page

        return rss


class PeakMemory:
    """Samples the process's allocated heap bytes on a thread while active."""

    def __init__(self, period: float = 0.0005) -> None:
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._read = allocated_bytes_reader()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._read())
            time.sleep(self.period)

    def __enter__(self) -> "PeakMemory":
        self.peak = self._read()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read())
