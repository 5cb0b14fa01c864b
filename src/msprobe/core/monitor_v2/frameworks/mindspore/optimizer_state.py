"""Where MindSpore optimizers keep their state, named as PyTorch names it.

Optimizer state lives in ``ParameterTuple`` attributes aligned with
``optimizer.parameters``: ``nn.Adam`` ``moment1``/``moment2``, ``nn.AdamWeightDecay``
``moments1``/``moments2``, ``mint.optim.AdamW`` ``exp_avg``/``exp_avg_sq``; these are
reported as ``exp_avg``/``exp_avg_sq`` like PyTorch's Adam. Momentum buffers
(``nn.Momentum`` ``moments``, ``nn.SGD`` ``accum``) are reported as PyTorch's
``momentum_buffer``; ``nn.SGD``'s ``stat`` (a first-step flag, not state of the
parameter's values) is left out. Any other per-parameter tuple is reported under its
own name.
"""

from typing import Any, List

from mindspore import ParameterTuple

from ... import rows


_ALIASES = {"moment1": rows.EXP_AVG, "moments1": rows.EXP_AVG, "moment2": rows.EXP_AVG_SQ,
            "moments2": rows.EXP_AVG_SQ, "moments": rows.MOMENTUM_BUFFER, "accum": rows.MOMENTUM_BUFFER}
_NOT_STATE = {"parameters", "_parameters", "params", "param_groups", "stat"}


def optimizer_states(optimizer: Any, n_params: int) -> List[tuple]:
    """``(report name, tuple of tensors)`` for each per-parameter state of ``optimizer``."""
    out = []
    for attr, value in vars(optimizer).items():
        if attr in _NOT_STATE or not isinstance(value, ParameterTuple) or len(value) != n_params:
            continue
        out.append((_ALIASES.get(attr, attr), value))
    order = {rows.EXP_AVG: 0, rows.EXP_AVG_SQ: 1}
    return sorted(out, key=lambda kv: order.get(kv[0], 2))
