"""Module and parameter names as the user's model has them: the one rule every PyTorch
monitor (``module``, ``weight_grad``, ``param``, ``optimizer``) names by.

A *pure wrapper* is a module whose forward calls one wrapped module with the inputs it
was given and returns that module's outputs, adding only checkpointing, offloading,
compilation, sharding or gradient synchronisation around the call:

- ``checkpoint_wrapper`` / ``offload_wrapper`` (``CheckpointWrapper``, ``OffloadWrapper``):
  the wrapped module is ``_checkpoint_wrapped_module``;
- ``torch.compile``'s ``OptimizedModule``: ``_orig_mod``;
- FSDP1's ``FullyShardedDataParallel``: ``_fsdp_wrapped_module``;
- torch's ``DistributedDataParallel`` and ``DataParallel``, DeepSpeed's
  ``DeepSpeedEngine``, Megatron's ``DistributedDataParallel`` and ``Float16Module``:
  ``module``.

The rule: a pure wrapper has no name of its own and no rows. The module it wraps takes
its place in the tree, under the wrapper's name, and so do that module's parameters and
submodules (``layers.0.attn``, never ``layers.0._checkpoint_wrapped_module.attn``). The
wrapper's own rows would repeat its child's (same inputs, same outputs), so only the
child is monitored. Wrappers are recognised by class (and its bases), never by attribute
name alone: ``module`` is also an ordinary attribute name in user models.
"""

from typing import Dict, Iterator, List, Optional, Set, Tuple

import torch

# (defining module, class name) -> attribute holding the wrapped module. Subclasses
# count too (``CheckpointWrapper``/``OffloadWrapper`` subclass ``ActivationWrapper``,
# DeepSpeed's ``PipelineEngine`` subclasses ``DeepSpeedEngine``).
_WRAPPER_CLASSES: Dict[Tuple[str, str], str] = {
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper"):
        "_checkpoint_wrapped_module",
    ("torch._dynamo.eval_frame", "OptimizedModule"): "_orig_mod",
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"): "_fsdp_wrapped_module",
    ("torch.nn.parallel.distributed", "DistributedDataParallel"): "module",
    ("torch.nn.parallel.data_parallel", "DataParallel"): "module",
    ("deepspeed.runtime.engine", "DeepSpeedEngine"): "module",
}
# Megatron moves its classes between releases (megatron.core.*, megatron.legacy.*):
# these names anywhere under ``megatron.`` are wrappers.
_MEGATRON_WRAPPERS = ("DistributedDataParallel", "Float16Module")

_ATTR_BY_TYPE: Dict[type, Optional[str]] = {}

# FSDP2's ``fully_shard`` (and ``replicate``) swap a module's class for a subclass made on
# the fly (``FSDPLinear`` over ``Linear``), defined in these packages.
_SWAPPED_CLASS_PACKAGES = ("torch.distributed.fsdp", "torch.distributed._composable")


def _wrapped_attr(kind: type) -> Optional[str]:
    """The attribute under which instances of ``kind`` keep the wrapped module, or None
    when ``kind`` is not a pure wrapper. Decided once per class."""
    if kind in _ATTR_BY_TYPE:
        return _ATTR_BY_TYPE[kind]
    attr = None
    for cls in kind.__mro__:
        attr = _WRAPPER_CLASSES.get((cls.__module__, cls.__name__))
        if attr is None and cls.__module__.startswith("megatron.") and cls.__name__ in _MEGATRON_WRAPPERS:
            attr = "module"
        if attr is not None:
            break
    _ATTR_BY_TYPE[kind] = attr
    return attr


def wrapped_module(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The module that ``module`` wraps when it is a pure wrapper (see the module
    docstring), else None. Only a registered submodule counts: its name is the one that
    would otherwise appear in paths."""
    attr = _wrapped_attr(type(module))
    if attr is None:
        return None
    inner = module._modules.get(attr)
    return inner if isinstance(inner, torch.nn.Module) else None


def class_name(module: torch.nn.Module) -> str:
    """The name of the user's class of ``module`` (what names a model's root), below
    the classes FSDP2 swaps in (``FSDPNet`` is named ``Net``)."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith(_SWAPPED_CLASS_PACKAGES):
            return cls.__name__
    return type(module).__name__


def is_wrapper(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a pure wrapper: it gets no rows, its wrapped module does."""
    return wrapped_module(module) is not None


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The user's module below any chain of pure wrappers."""
    for _ in range(64):  # wrappers of wrappers; a cycle is impossible in a module tree
        inner = wrapped_module(module)
        if inner is None:
            return module
        module = inner
    return module


def _walk(root: torch.nn.Module, wrappers: bool) -> Iterator[Tuple[str, torch.nn.Module, bool]]:
    """``(model name, module, is_wrapper)`` in ``named_modules()`` order, each module
    once (under its first name); a wrapper's wrapped module gets the wrapper's name."""
    seen: Set[int] = set()
    stack: List[Tuple[str, torch.nn.Module]] = [("", root)]
    while stack:
        prefix, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        inner = wrapped_module(module)
        if inner is not None and wrappers:
            yield prefix, module, True
        elif inner is None:
            yield prefix, module, False
        children = []
        for name, child in module._modules.items():
            if child is None:
                continue
            if child is inner:
                children.append((prefix, child))
            else:
                children.append((f"{prefix}.{name}" if prefix else name, child))
        stack.extend(reversed(children))


def named_modules(root: torch.nn.Module, wrappers: bool = False) -> Iterator[Tuple[str, torch.nn.Module]]:
    """``(name, module)`` of the real modules under ``root`` with the model's own names
    (the root's name is empty), in ``named_modules()`` order, each once; pure wrappers
    are left out (``wrappers=True``: included, under the name of the module they wrap,
    before it)."""
    for name, module, _ in _walk(root, wrappers):
        yield name, module


def named_parameters(root: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` under ``root`` with the model's own names, each parameter
    once, in ``named_parameters()`` order. A parameter a wrapper registers on itself is
    named as if its wrapped module held it."""
    seen: Set[int] = set()
    for prefix, module, _ in _walk(root, wrappers=True):
        for name, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            yield (f"{prefix}.{name}" if prefix else name), p


def clean_path(start: torch.nn.Module, path: str) -> str:
    """``path`` (a dotted name relative to ``start``, as a framework records it, e.g.
    FSDP1's flat-parameter ``_fqns``) with the components that name a pure wrapper's
    wrapped module left out. Components are resolved against the modules themselves;
    from the first one that is not a submodule (a parameter's name) on, they are kept."""
    parts = path.split(".") if path else []
    out: List[str] = []
    module: Optional[torch.nn.Module] = start
    for i, part in enumerate(parts):
        child = module._modules.get(part) if module is not None else None
        if child is None:
            out.extend(parts[i:])
            break
        if child is not wrapped_module(module):
            out.append(part)
        module = child
    return ".".join(out)
