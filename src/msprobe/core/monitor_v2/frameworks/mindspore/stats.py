"""Device side of the statistics engine for MindSpore (PyNative).

The same contract as the PyTorch engine: each tensor becomes a 4-vector
``[min, max, sum, norm]`` in fp32 (fp64 for fp64 tensors) on its device, plus a NaN
count when one is needed; ``to_host`` moves a step's vectors with one transfer per
dtype. Low-precision and integer tensors are cast to fp32 first (MindSpore's CPU
reductions have no bf16 kernels), a temporary freed at once.

MindSpore's CPU ``min``/``max`` skip NaN; the NaN count is therefore also taken when
``min``/``max`` are asked for, and the host side reports NaN min/max for any tensor that
holds a NaN. The count is always computed on the device: PyNative may run operators
asynchronously, so reading a probe value back in a hook could wait for the device.
"""

from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import mindspore as ms
from mindspore import ops

from ...stats import EMPTY_VECTOR, Record, StatPlan

_FLOATS = (ms.float32, ms.float64)


class MsStatsEngine:
    def __init__(self) -> None:
        self._zeros: Dict[object, ms.Tensor] = {}

    def _zero(self, dtype) -> ms.Tensor:
        z = self._zeros.get(dtype)
        if z is None:
            z = self._zeros[dtype] = ms.Tensor(0, dtype)
        return z

    def _vector(self, t: ms.Tensor, plan: StatPlan) -> Tuple[ms.Tensor, Optional[ms.Tensor]]:
        if t.dtype not in _FLOATS:
            t = t.astype(ms.float32)
        zero = self._zero(t.dtype)
        mn = t.min() if plan.minmax else zero
        mx = t.max() if plan.minmax else zero
        total = t.sum() if plan.total else zero
        norm = ops.norm(t.reshape(-1)) if plan.norm else zero
        vector = ops.stack((mn, mx, total, norm))
        nans = ops.isnan(t).sum() if (plan.nans or plan.minmax) else None
        return vector, nans

    def record(self, t: ms.Tensor, plan: StatPlan, vpp_stage: int, name: str, scope: str,
               micro_step: Optional[int] = None, cache: bool = False) -> Record:
        numel = int(t.size)
        if numel == 0:
            return Record(vpp_stage, name, scope, micro_step, EMPTY_VECTOR, 0, 0)
        vector, nans = self._vector(t, plan)
        return Record(vpp_stage, name, scope, micro_step, vector, nans, numel)

    def record_many(self, tensors: Sequence[ms.Tensor], plan: StatPlan,
                    keys: Sequence[Tuple[int, str, str, Optional[int]]]) -> List[Record]:
        return [self.record(t, plan, *key) for t, key in zip(tensors, keys)]

    def forget(self) -> None:
        """Nothing is cached in MindSpore; the same interface as the PyTorch engine."""

    def to_host(self, records: Sequence[Record]) -> None:
        vec_groups: Dict[object, List[Record]] = defaultdict(list)
        nan_groups: List[Record] = []
        for rec in records:
            if isinstance(rec.vector, ms.Tensor):
                vec_groups[rec.vector.dtype].append(rec)
            if isinstance(rec.nans, ms.Tensor):
                nan_groups.append(rec)
        for recs in vec_groups.values():
            host = ops.stack([r.vector for r in recs]).asnumpy().tolist()
            for rec, values in zip(recs, host):
                rec.vector = values
        if nan_groups:
            host = ops.stack([r.nans.astype(ms.int64) for r in nan_groups]).asnumpy().tolist()
            for rec, value in zip(nan_groups, host):
                rec.nans = value
