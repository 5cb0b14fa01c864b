"""A dispatch mode that counts the statistics engine's own ATen calls.

The engine sets the training's dispatch modes aside while it computes (none of them sees
its work: tests/pytorch/test_dispatch_modes.py). A mode made to count the engine's calls
(ops, bytes, launches) subclasses ``SeenByTheEngine``: while it is entered, the mode
stacks' lengths are hidden from the engine's check, so the engine runs inside it. PyTorch
only: import after torch is known to be installed."""

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
