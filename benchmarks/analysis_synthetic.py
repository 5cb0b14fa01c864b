"""A synthetic monitor output of a chosen size, with anomalies at known places.

Used by ``benchmarks/analysis_throughput.py`` and its CI smoke test. The layout and the
CSV format are the monitor's (``rank_<r>/weight_grad_step<a>-<b>.csv``, header
``vpp_stage,step,module_name,scope,micro_step,min,max,mean,norm,nans``). Each step of
each rank has ``2 * tensors`` rows: an ``unreduced`` (local, micro_step 1) and a
``reduced`` row per tensor; reduced rows are identical on every rank, as under data
parallelism. Values vary by a few percent from step to step, so nothing is a spike
except what is injected:

- a NaN in the local gradient of tensor ``NAN_TENSOR`` on rank ``min(1, ranks-1)`` at
  step ``nan_step`` (its reduced row is NaN on every rank that step);
- a spike (norm and max x 100) in the local gradient of tensor ``SPIKE_TENSOR`` on the
  last rank at step ``spike_step``;
- a rank disagreement: the reduced norm of tensor ``DESYNC_TENSOR`` on the last rank at
  step ``desync_step`` is 1 % off (only with more than one rank).

Files are written with Polars (fast); the values are not fp32-exact like the monitor's,
which does not matter to the reader.
"""

import os
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

NAN_TENSOR, SPIKE_TENSOR, DESYNC_TENSOR = 7, 11, 13


@dataclass
class Expected:
    """Where the anomalies were injected (what the analysis must find)."""

    nan_rank: int
    nan_step: int
    nan_tensor: str
    spike_rank: int
    spike_step: int
    spike_tensor: str
    desync_rank: Optional[int]
    desync_step: int
    desync_tensor: str
    rows: int
    files: int


def tensor_name(i: int) -> str:
    return f"model.layers.{i // 6}.{('attn.qkv', 'attn.proj', 'mlp.fc1', 'mlp.fc2', 'ln1', 'ln2')[i % 6]}.weight"


def expected_for(ranks: int, steps: int, tensors: int) -> Expected:
    nan_step = max(steps * 3 // 4, 12)
    spike_step = max(steps // 2, 11)
    desync_step = max(steps // 4, 1)
    return Expected(nan_rank=min(1, ranks - 1), nan_step=nan_step, nan_tensor=tensor_name(NAN_TENSOR % tensors),
                    spike_rank=ranks - 1, spike_step=spike_step, spike_tensor=tensor_name(SPIKE_TENSOR % tensors),
                    desync_rank=ranks - 1 if ranks > 1 else None, desync_step=desync_step,
                    desync_tensor=tensor_name(DESYNC_TENSOR % tensors),
                    rows=ranks * steps * tensors * 2, files=ranks * steps)


def write_output(root: str, ranks: int, steps: int, tensors: int, steps_per_file: int = 1,
                 seed: int = 0) -> Expected:
    """Write ``ranks * steps * 2 * tensors`` rows under ``root`` and return where the
    anomalies are. Steps start at 0; a file holds ``steps_per_file`` steps."""
    import polars as pl

    if steps < 16 or tensors <= max(NAN_TENSOR, SPIKE_TENSOR, DESYNC_TENSOR):
        raise ValueError("need at least 16 steps and 14 tensors (the anomalies are injected there)")
    exp = expected_for(ranks, steps, tensors)
    rng = np.random.default_rng(seed)
    names = [tensor_name(i) for i in range(tensors)]
    base = 10.0 ** rng.uniform(-3, 1, size=tensors)  # each tensor's own level
    n_files = 0
    for first in range(0, steps, steps_per_file):
        last = min(first + steps_per_file, steps) - 1
        frames: Dict[int, list] = {r: [] for r in range(ranks)}
        for step in range(first, last + 1):
            reduced = base * (1.0 + 0.02 * rng.random(tensors))
            for r in range(ranks):
                local = base * (1.0 + 0.02 * rng.random(tensors))
                red = reduced.copy()
                loc = local.copy()
                if r == exp.spike_rank and step == exp.spike_step:
                    loc[SPIKE_TENSOR] *= 100.0
                if r == exp.desync_rank and step == exp.desync_step:
                    red[DESYNC_TENSOR] *= 1.01
                nans = np.zeros(2 * tensors, dtype=np.int64)
                norm = np.concatenate([loc, red])
                if step == exp.nan_step:
                    if r == exp.nan_rank:
                        norm[NAN_TENSOR] = np.nan
                        nans[NAN_TENSOR] = 3
                    norm[tensors + NAN_TENSOR] = np.nan
                    nans[tensors + NAN_TENSOR] = 3
                mx = norm * 0.05
                frames[r].append(pl.DataFrame({
                    "vpp_stage": np.zeros(2 * tensors, dtype=np.int64),
                    "step": np.full(2 * tensors, step, dtype=np.int64),
                    "module_name": names + names,
                    "scope": ["unreduced"] * tensors + ["reduced"] * tensors,
                    "micro_step": np.ones(2 * tensors, dtype=np.int64),
                    "min": -mx * 0.9, "max": mx, "mean": norm * 1e-4, "norm": norm, "nans": nans,
                }))
        for r in range(ranks):
            d = os.path.join(root, f"rank_{r}")
            os.makedirs(d, exist_ok=True)
            pl.concat(frames[r]).write_csv(os.path.join(d, f"weight_grad_step{first}-{last}.csv"),
                                           float_precision=6)
            n_files += 1
    exp.files = n_files
    return exp
