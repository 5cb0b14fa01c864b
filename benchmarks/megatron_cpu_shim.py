"""CPU shim for the Megatron-Core benchmark and tests: lets Megatron-Core 0.16.1 train on a CPU-only torch build with gloo.

Megatron-Core hard-codes a few CUDA calls on paths that a GPTModel with TP=PP=1 and its
DDP/optimizers reach: ``device='cuda'`` factories (optimizer, grad scaler, clip_grads),
``torch.cuda.current_device()`` (grad buffers), the CUDA RNG tracker and
``param.type() == 'torch.cuda.FloatTensor'`` checks. ``install()`` points them at the
CPU; the returned function undoes it. Never imported by the package itself.
"""

import contextlib
import logging
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # an index means a GPU


class CudaToCpuMode(TorchFunctionMode):
    """``device='cuda'`` (or a GPU index) becomes the CPU, ``Tensor.cuda()`` is the
    identity and a bare ``Tensor.type()`` answers ``torch.cuda.X``."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


def install(mode: bool = True) -> Callable[[], None]:
    """Point Megatron's CUDA calls at the CPU for the rest of the process (or until the
    undo is called). ``mode=False`` leaves out the TorchFunctionMode (which sees every
    torch call): enter ``CudaToCpuMode()`` yourself around model and optimizer
    construction and ``optimizer.step()``; forward and backward do not need it."""
    import megatron.core.tensor_parallel.random as mrandom

    saved = [
        # A device, not an index: factories given device=torch.cuda.current_device() then
        # work without the mode (forward and backward run outside it in the benchmark).
        (torch.cuda, "current_device", lambda: torch.device("cpu")),
        (torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state()),
        (torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(seed)),
        (mrandom, "_get_cuda_rng_state", lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()),
        (mrandom, "_set_cuda_rng_state", lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)),
    ]
    originals = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in saved]
    for obj, attr, fn in saved:
        setattr(obj, attr, fn)
    # The tracker's CUDA states are the CPU generator here: it warns that the CPU state
    # changed inside a fork, which is expected.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)
    stack = contextlib.ExitStack()
    if mode:
        stack.enter_context(CudaToCpuMode())

    def undo() -> None:
        stack.close()
        for obj, attr, fn in originals:
            setattr(obj, attr, fn)

    return undo
