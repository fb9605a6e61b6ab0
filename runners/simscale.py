"""How the wall time of a simulation grows with the fleet (`python -m runners.bench simulation`).

Each case is `configs/sim-swe-64.toml` resized to N engines: N/8 environments, 8 SWE
trajectories per engine (N/8 tasks x G = 8), one sync step, the same seed. `--turns-max`
caps the SWE episodes so the largest fleets finish in minutes; the full profile is
`python -m runners.simulate configs/sim-swe-64.toml`. Prints, per fleet, the model seconds
simulated, the wall (and CPU) seconds they took and both ratios, and writes `simscale.json`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec

from actors.config import Config, load_config

BASE_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "sim-swe-64.toml"
TRAJECTORIES_PER_ENGINE = 8


def scaled_config(engines: int, turns_max: int | None, base: Path = BASE_CONFIG) -> Config:
    raw = msgspec.to_builtins(load_config(base))
    envs = max(1, engines // 8)
    trajectories = engines * TRAJECTORIES_PER_ENGINE
    raw["run"]["name"] = f"simscale-{engines}"
    raw["engines"].update(count=engines, prefill_engines=max(1, engines // 4))
    raw["environments"].update(count=envs, max_live_trajectories=-(-trajectories // envs))
    samples = raw["trainer"]["samples_per_task"]
    raw["trainer"].update(steps=1, tasks_per_step=trajectories // samples)
    if turns_max is not None:
        raw["workload"].setdefault("overrides", {}).setdefault("swe", {})["turns_max"] = turns_max
    return msgspec.convert(raw, Config)


def run(engine_counts: list[int], turns_max: int | None, out: Path) -> list[dict]:
    from runners import simulate

    simulate.console.quiet = True
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for engines in engine_counts:
        config = scaled_config(engines, turns_max)
        started, started_cpu = time.monotonic(), time.process_time()
        summary = simulate.run(config, out / f"engines-{engines}", show_progress=False)
        wall_s, cpu_s = time.monotonic() - started, time.process_time() - started_cpu
        model_s = last_event_s(out / f"engines-{engines}")
        row = {
            "engines": engines,
            "trajectories": summary["trajectories_finished"],
            "status": summary["status"],
            "events": summary["events"],
            "model_s": round(model_s, 1),
            "wall_s": round(wall_s, 2),
            "cpu_s": round(cpu_s, 2),  # (wall > cpu: the machine was shared)
            "model_s_per_wall_s": round(model_s / wall_s, 1),
            "wall_ms_per_model_s": round(1e3 * wall_s / model_s, 2),
        }
        rows.append(row)
        print(
            f"{engines:5d} engines: {row['trajectories']} trajectories, {row['model_s']:,.0f} model s in {row['wall_s']:,.1f} s wall "
            f"({row['cpu_s']:,.1f} s CPU) = {row['model_s_per_wall_s']:,.1f} model s per wall s ({row['wall_ms_per_model_s']:.1f} ms wall per model s), "
            f"{row['events']:,} events, {row['status']}",
            flush=True,
        )
    (out / "simscale.json").write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def last_event_s(run_dir: Path) -> float:
    """The model time a run covered: its last lifecycle event."""
    import polars as pl

    return float(pl.read_parquet(run_dir / "events.parquet")["at_s"].max())
