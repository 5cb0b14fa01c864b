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


# ----------------------------------------------------------------------- a model-parallel run
LAYER_KINDS = ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
               "mlp.linear_fc2.weight", "input_layernorm.weight", "pre_mlp_layernorm.weight")
PER_LAYER = len(LAYER_KINDS)


@dataclass
class ParallelExpected:
    """What ``msprobe-monitor merge`` must find in :func:`write_parallel_output`'s run."""

    rows: int                 # rows written by all ranks
    files: int
    merged_rows: int          # rows of the merged weight_grad.csv
    disagreement: tuple       # (step, global name, scope, the rank that is off)
    values: Dict[tuple, float]  # (step, global name, scope, dp_rank or "") -> the whole tensor's norm


def _split(j: int) -> bool:
    # the layernorm weights are replicated over tensor parallelism; the linear layers are split
    return j % PER_LAYER < 4


def write_parallel_output(root: str, tp: int, pp: int, dp: int, steps: int, params: int, steps_per_file: int = 1,
                          seed: int = 0) -> ParallelExpected:
    """A Megatron-like run of ``tp * pp * dp`` ranks (rank = tp_rank + tp * (dp_rank + dp *
    pp_rank)), each writing ``weight_grad`` rows (``unreduced`` and ``reduced``) of the
    ``params`` parameters of its pipeline stage, and its ``layout.json``: linear weights
    split along tp (``["tp", t, tp]``), layernorm weights replicated over tp; stage ``p``'s
    local layer ``k`` is global layer ``p * layers + k``. Reduced rows are equal on every
    data-parallel replica, except one: the norm of a split parameter on one rank at step
    ``steps // 2`` is 1 % off (the disagreement merge must report)."""
    import polars as pl

    sys_path_src()
    from msprobe.core.monitor_v2 import layout as lay

    rng = np.random.default_rng(seed)
    layers = -(-params // PER_LAYER)
    local_names = [f"decoder.layers.{j // PER_LAYER}.{LAYER_KINDS[j % PER_LAYER]}" for j in range(params)]
    split = np.array([_split(j) for j in range(params)])
    numel = np.array([4096 * tp if _split(j) else 64 for j in range(params)], dtype=np.int64)  # whole tensor
    world = tp * pp * dp
    off_step = steps // 2
    off_param = next(j for j in range(params) if _split(j) and j >= 7)
    off = dict(p=pp - 1, d=min(3, dp - 1), t=min(1, tp - 1))
    off_rank = off["t"] + tp * (off["d"] + dp * off["p"])
    values: Dict[tuple, float] = {}
    watch = {0, off_step, steps - 1}
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                r = t + tp * (d + dp * p)
                rank_dir = os.path.join(root, f"rank_{r}")
                os.makedirs(rank_dir, exist_ok=True)
                doc = lay.new_document("pytorch", "synthetic", r, world)
                doc["groups"] = {"dp": lay.group(d, dp), "tp": lay.group(t, tp), "pp": lay.group(p, pp)}
                doc["chunks"] = [{"vpp_stage": 0, "layer_offset": p * layers, "layers": layers}]
                doc["rename"] = [[f"decoder.layers.{k}.", f"decoder.layers.{p * layers + k}."] for k in range(layers)]
                for j, name in enumerate(local_names):
                    n = int(numel[j])
                    piece = lay.piece(n // tp, [["tp", t, tp]]) if split[j] else lay.piece(n)
                    doc["params"][name] = {"shape": [n // 64, 64], "pieces": {c: piece for c in lay.SCOPE_CLASSES}}
                lay.write_layout(rank_dir, doc)
    n_files = 0
    base = 10.0 ** rng.uniform(-3, 0, size=params)
    for first in range(0, steps, steps_per_file):
        last = min(first + steps_per_file, steps) - 1
        frames: Dict[int, list] = {r: [] for r in range(world)}
        for step in range(first, last + 1):
            for p in range(pp):
                # the pieces' norms: reduced per tp piece (equal on every dp replica), unreduced per dp and piece;
                # a replicated parameter's tp "pieces" are replicas, equal too
                red = base * (1.0 + 0.02 * rng.random((tp, params)))
                loc = base * (1.0 + 0.02 * rng.random((dp, tp, params)))
                red[:, ~split] = red[0, ~split]
                loc[:, :, ~split] = loc[:, :1, ~split]
                if step in watch:
                    for j in (off_param, params - 1):
                        g = f"decoder.layers.{p * layers + j // PER_LAYER}.{LAYER_KINDS[j % PER_LAYER]}"
                        pieces = red[:, j] if split[j] else red[:1, j]
                        values[(step, g, "reduced", "")] = float(np.sqrt(np.sum(pieces ** 2)))
                        for d in range(dp):
                            pieces = loc[d, :, j] if split[j] else loc[d, :1, j]
                            values[(step, g, "unreduced", str(d))] = float(np.sqrt(np.sum(pieces ** 2)))
                for d in range(dp):
                    for t in range(tp):
                        r = t + tp * (d + dp * p)
                        rn = red[t].copy()
                        if step == off_step and r == off_rank:
                            rn[off_param] *= 1.01
                        norm = np.concatenate([loc[d, t], rn])
                        frames[r].append(pl.DataFrame({
                            "vpp_stage": np.zeros(2 * params, dtype=np.int64),
                            "step": np.full(2 * params, step, dtype=np.int64),
                            "module_name": local_names + local_names,
                            "scope": ["unreduced"] * params + ["reduced"] * params,
                            "micro_step": np.ones(2 * params, dtype=np.int64),
                            "min": -norm * 0.05, "max": norm * 0.05, "mean": norm * 1e-4, "norm": norm,
                            "nans": np.zeros(2 * params, dtype=np.int64),
                        }))
        for r in range(world):
            d = os.path.join(root, f"rank_{r}")
            pl.concat(frames[r]).write_csv(os.path.join(d, f"weight_grad_step{first}-{last}.csv"),
                                           float_precision=9)
            n_files += 1
    g_off = f"decoder.layers.{off['p'] * layers + off_param // PER_LAYER}.{LAYER_KINDS[off_param % PER_LAYER]}"
    return ParallelExpected(rows=world * steps * 2 * params, files=n_files,
                            merged_rows=steps * pp * params * (1 + dp),
                            disagreement=(off_step, g_off, "reduced", off_rank), values=values)


def sys_path_src() -> None:
    """``src`` importable (the layout document is the package's own)."""
    import sys

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    if src not in sys.path:
        sys.path.insert(0, src)
