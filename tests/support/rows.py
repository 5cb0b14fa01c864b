"""Reading the monitor's CSV output: a file, a rank directory, one monitor's rows."""

import csv
from pathlib import Path
from typing import Dict, List


def read_csv(path) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_rank_dir(out_dir, rank: int = 0) -> Dict[str, List[Dict[str, str]]]:
    """All CSV files of a rank directory: file name -> rows."""
    d = Path(out_dir) / f"rank_{rank}"
    return {p.name: read_csv(p) for p in sorted(d.glob("*.csv"))}


def rows_of(out_dir, monitor: str, rank: int = 0) -> List[Dict[str, str]]:
    """Every row a monitor wrote on a rank, in file order (files sorted by first step)."""
    d = Path(out_dir) / f"rank_{rank}"
    files = sorted(d.glob(f"{monitor}_step*.csv"), key=lambda p: int(p.name.split("step")[1].split("-")[0]))
    rows: List[Dict[str, str]] = []
    for p in files:
        rows.extend(read_csv(p))
    return rows


def find_row(rows, **match) -> Dict[str, str]:
    found = [r for r in rows if all(r[k] == str(v) for k, v in match.items())]
    assert len(found) == 1, f"expected exactly one row matching {match}, found {len(found)}"
    return found[0]
