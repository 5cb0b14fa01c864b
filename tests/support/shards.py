"""Checks shared by the DeepSpeed integration tests: rows of local shards against the
whole tensor."""

import math
from typing import List

import torch

from support import numpy_stats


def assert_shards_make_up(per_rank: List[List[dict]], full: torch.Tensor, rtol: float, atol: float, what) -> None:
    """Each rank reports its local shard of the tensor (one row, or none where it holds
    none of it); together they make it up: sqrt of the summed squared norms is its norm,
    min/max of the minima/maxima its minimum/maximum."""
    got = [rows[0] for rows in per_rank if rows]
    assert got and all(len(rows) <= 1 for rows in per_rank), (what, per_rank)
    ref = numpy_stats(full)
    norm = math.sqrt(sum(float(x["norm"]) ** 2 for x in got))
    assert math.isclose(norm, ref["norm"], rel_tol=rtol, abs_tol=atol), (what, norm, ref["norm"])
    assert math.isclose(min(float(x["min"]) for x in got), ref["min"], rel_tol=rtol, abs_tol=atol), what
    assert math.isclose(max(float(x["max"]) for x in got), ref["max"], rel_tol=rtol, abs_tol=atol), what
    assert sum(int(x["nans"]) for x in got) == 0
