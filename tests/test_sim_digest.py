"""A simulation's outputs, pinned: the same config and seed must give the same events and
figures as the stored digests (tests/data/sim-digest.json), whatever makes the simulation
faster.

    python -m tests.test_sim_digest RUN_DIR [RUN_DIR ...]   # print a run folder's digests

Each digest is a sha256 of a table's content, row by row in file order, as Python writes the
values (`repr`): independent of how a polars version lays out a parquet file. The events are
hashed exactly. The forecasts and the allocator's figures come out of numpy's and statsmodels'
arithmetic, whose last bits depend on the CPU's vector instructions (AVX2 and AVX-512 sum
in different orders: differences of 1e-13 relative, measured); their floats are hashed at
SIGNIFICANT_DIGITS, so a digest names the model's figures, not the machine that ran it. The summary's
figures (`FIGURES`: every one the model decides; not `wall_s`, which the machine decides)
are hashed as sorted JSON. A stored digest changes only when the model changes on purpose: then run the two
configs with `python -m runners.simulate tests/data/CONFIG.toml --out DIR`, look at what
moved, and store the new digests.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import polars as pl
import pytest

from actors.config import load_config
from runners.simulate import run

DATA = Path(__file__).resolve().parent / "data"
STORED = DATA / "sim-digest.json"
CONFIGS = ("sim-digest-prorsa", "sim-digest-dp-async")
TABLES = ("events", "forecasts", "allocations")  # the parquet files a simulation writes (the last two when there are any)
ROUNDED = ("forecasts", "allocations")  # ... whose floats are hashed at SIGNIFICANT_DIGITS
SIGNIFICANT_DIGITS = 8
FIGURES = (  # summary.json's model figures
    "status",
    "time_scale",
    "policy",
    "mode",
    "backend",
    "trajectories_expected",
    "trajectories_finished",
    "trajectories_trained",
    "trajectories_dropped",
    "trajectories_lost",
    "trajectories_extra",
    "invalid_messages",
    "events",
    "steps",
    "actors",
    "incomplete_trajectories",
)


def frame_digest(frame: pl.DataFrame, rounded: bool = False) -> str:
    """sha256 of the column names and every row's values, in order (`rounded`: floats at
    SIGNIFICANT_DIGITS)."""
    if rounded:
        frame = frame.with_columns(pl.col(pl.Float64, pl.Float32).round_sig_figs(SIGNIFICANT_DIGITS))
    h = hashlib.sha256(repr(frame.columns).encode())
    for row in frame.iter_rows():
        h.update(repr(row).encode())
        h.update(b"\n")
    return h.hexdigest()


def summary_digest(summary: dict) -> str:
    figures = {k: summary[k] for k in FIGURES}
    return hashlib.sha256(json.dumps(figures, sort_keys=True).encode()).hexdigest()


def digests(out: Path) -> dict[str, str]:
    found = {"summary": summary_digest(json.loads((out / "summary.json").read_text()))}
    for table in TABLES:
        path = out / f"{table}.parquet"
        if path.exists():
            found[table] = frame_digest(pl.read_parquet(path), rounded=table in ROUNDED)
    return found


@pytest.mark.parametrize("name", CONFIGS)
def test_simulation_outputs_match_the_stored_digests(tmp_path: Path, name: str):
    summary = run(load_config(DATA / f"{name}.toml"), tmp_path / name, show_progress=False)
    assert summary["status"] == "completed"
    assert digests(tmp_path / name) == json.loads(STORED.read_text())[name]


if __name__ == "__main__":
    print(json.dumps({Path(arg).name: digests(Path(arg)) for arg in sys.argv[1:]}, indent=2))
