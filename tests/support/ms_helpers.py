"""Shared pieces of the MindSpore tests: the PyNative/CPU context, tiny Cells with weights
set from NumPy, and NumPy reference statistics.

Importing this module sets ``PYNATIVE_MODE`` on the CPU for the test process. Every
reference value is computed with NumPy (fp64) on copies (``asnumpy().copy()``) or with
an independent MindSpore computation on an unmonitored twin network, never with the
code under test.
"""

import math
from typing import Dict, Sequence

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")

D_IN, D_HIDDEN, D_OUT = 4, 6, 3


def init_arrays(seed: int = 0, d_in: int = D_IN, d_hidden: int = D_HIDDEN, d_out: int = D_OUT) -> Dict[str, np.ndarray]:
    """Initial weights by parameter name; Dense and torch Linear weights are (out, in)."""
    rng = np.random.default_rng(seed)
    shapes = {"fc1.weight": (d_hidden, d_in), "fc1.bias": (d_hidden,),
              "fc2.weight": (d_out, d_hidden), "fc2.bias": (d_out,)}
    return {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in shapes.items()}


class MLP(nn.Cell):
    """fc1 -> ReLU -> fc2 with weights from ``init_arrays``; parameter names ``fc1.weight``..."""

    def __init__(self, seed: int = 0, d_in: int = D_IN, d_hidden: int = D_HIDDEN, d_out: int = D_OUT) -> None:
        super().__init__()
        self.fc1 = nn.Dense(d_in, d_hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Dense(d_hidden, d_out)
        set_weights(self, init_arrays(seed, d_in, d_hidden, d_out))

    def construct(self, x):
        return self.fc2(self.act(self.fc1(x)))


def set_weights(net: nn.Cell, arrays: Dict[str, np.ndarray]) -> None:
    params = dict(net.parameters_and_names())
    assert set(params) == set(arrays), (sorted(params), sorted(arrays))
    for name, a in arrays.items():
        params[name].set_data(Tensor(a.copy()))


def weights_of(net: nn.Cell) -> Dict[str, np.ndarray]:
    return {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}


def batches(n: int, batch: int = 5, d_in: int = D_IN, d_out: int = D_OUT, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, d_in)).astype(np.float32),
             rng.standard_normal((batch, d_out)).astype(np.float32)) for _ in range(n)]


def mse(net: nn.Cell):
    def forward(x, y):
        return ((net(x) - y) ** 2).mean()

    return forward


def grads_np(grads: Sequence[Tensor]):
    return [g.asnumpy().copy() for g in grads]


def np_stats(a) -> Dict[str, float]:
    """The five statistics of ``a`` with NumPy in fp64."""
    a = np.asarray(a, dtype=np.float64).ravel()
    if a.size == 0:
        return {"min": math.nan, "max": math.nan, "mean": math.nan, "norm": 0.0, "nans": 0}
    with np.errstate(invalid="ignore", over="ignore"):
        return {
            "min": float(np.min(a)),
            "max": float(np.max(a)),
            "mean": float(np.mean(a)),
            "norm": float(np.sqrt(np.sum(a * a))),
            "nans": int(np.isnan(a).sum()),
        }


def relu_np(z: np.ndarray) -> np.ndarray:
    return np.maximum(z, 0)


__all__ = ["ms", "nn", "ops", "Tensor", "np", "MLP", "init_arrays", "set_weights", "weights_of", "batches",
           "mse", "grads_np", "np_stats", "relu_np", "D_IN", "D_HIDDEN", "D_OUT"]
