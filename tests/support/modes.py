"""Dispatch modes for tests: one that counts the statistics engine's own ATen calls, and a
user's mode that records what it sees (``OpRecorder``).

The engine sets the training's dispatch modes aside while it computes (none of them sees
its work: tests/pytorch/test_dispatch_modes.py). A mode made to count the engine's calls
(ops, bytes, launches) subclasses ``SeenByTheEngine``: while it is entered, the mode
stacks' lengths are hidden from the engine's check, so the engine runs inside it. PyTorch
only: import after torch is known to be installed."""

from typing import Any, List

from torch.utils._python_dispatch import TorchDispatchMode

from msprobe.core.monitor_v2.frameworks.pytorch import stats as torch_stats


class SeenByTheEngine(TorchDispatchMode):
    """A ``TorchDispatchMode`` the engine does not set aside (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self._checks = ()

    def __enter__(self):
        self._checks = (torch_stats._dispatch_modes, torch_stats._function_modes)
        torch_stats._dispatch_modes = torch_stats._function_modes = lambda: 0
        return super().__enter__()

    def __exit__(self, *exc):
        torch_stats._dispatch_modes, torch_stats._function_modes = self._checks
        return super().__exit__(*exc)


class OpRecorder(TorchDispatchMode):
    """A user's dispatch mode: the name of every ATen op it sees (the engine sets it aside
    while it computes, so a monitored run must show it the same ops as a plain one)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
