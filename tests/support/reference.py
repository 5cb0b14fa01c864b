"""Independent reference statistics (NumPy, fp64, on a copy) and the row comparison."""

import math
from typing import Dict

import numpy as np
import torch


def numpy_stats(t: torch.Tensor) -> Dict[str, float]:
    """Independent reference: the five statistics with NumPy (fp64) on a copy."""
    a = t.detach().to(torch.float64).cpu().numpy().copy().ravel()
    if a.size == 0:
        return {"min": float("nan"), "max": float("nan"), "mean": float("nan"), "norm": 0.0, "nans": 0}
    return {
        "min": float(np.min(a)),
        "max": float(np.max(a)),
        "mean": float(np.mean(a)),
        "norm": float(np.sqrt(np.sum(a * a))),
        "nans": int(np.isnan(a).sum()),
    }


def assert_row_matches(row: Dict[str, str], expected: Dict[str, float], rtol: float = 1e-5, atol: float = 1e-7) -> None:
    for op, want in expected.items():
        if op not in row:
            continue
        got = float(row[op]) if op != "nans" else int(row[op])
        if isinstance(want, float) and math.isnan(want):
            assert math.isnan(got), f"{op}: expected nan, got {row[op]}"
        elif isinstance(want, float) and math.isinf(want):
            assert got == want, f"{op}: expected {want}, got {row[op]}"
        else:
            assert math.isclose(got, want, rel_tol=rtol, abs_tol=atol), f"{op}: expected {want}, got {row[op]} (row {row})"
