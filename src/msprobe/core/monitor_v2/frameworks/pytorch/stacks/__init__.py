"""Training-stack adapters (what a framework that wraps the model and the optimizer
keeps where): ``base`` holds the plain-torch adapter, the hook points and the detection;
``deepspeed``, ``megatron`` and ``fsdp`` know their framework. See ``base``'s docstring."""

from ....patching import wrap_method
from .base import GradCallback, TrainingStack, UnreducedCapture, detect_stack, hookable_optimizer, \
    optimizer_step_hooks, tensor_states

__all__ = ["GradCallback", "TrainingStack", "UnreducedCapture", "detect_stack", "hookable_optimizer",
           "optimizer_step_hooks", "tensor_states", "wrap_method"]
