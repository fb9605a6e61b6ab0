"""The lifecycle log as a polars frame: one row per LifecycleEvent, its schema checks, and
reading an exported `events.parquet`. Below actors, forecasting and ops: the forecaster, the
oracle's demand reader, the replay runner and the exporter all read the log through here."""

from __future__ import annotations

import logging
from pathlib import Path

import polars as pl

from bus_schemas.lifecycle import SCHEMA_VERSION, LifecycleEvent

LOG = logging.getLogger("prorsa.eventlog")


EVENT_COLUMNS = set(LifecycleEvent.__struct_fields__)


_EVENTS_SCHEMA = {
    "event_id": pl.String,
    "kind": pl.String,
    "at_s": pl.Float64,
    "actor_id": pl.String,
    "trajectory_id": pl.String,
    "turn": pl.Int64,
    "attempt": pl.Int64,
    "task_family": pl.String,
    "policy_version": pl.Int64,
    "step": pl.Int64,
    "engine_id": pl.String,
    "role": pl.String,
    "new_tokens": pl.Int64,
    "cached_prefix_tokens": pl.Int64,
    "context_tokens": pl.Int64,
    "generated_tokens": pl.Int64,
    "kv_bytes": pl.Int64,
    "duration_s": pl.Float64,
    "reward": pl.Float64,
    "detail": pl.String,
}
assert set(_EVENTS_SCHEMA) == set(EVENT_COLUMNS), "events_frame schema out of date with LifecycleEvent"


def events_frame(events: list[LifecycleEvent]) -> pl.DataFrame:
    """One row per event, sorted by time (ties by event id). Built column by column: a
    column of plain values per field goes into polars at once, where rows of dicts are
    read one value at a time."""
    columns = {name: [getattr(e, name) for e in events] for name in _EVENTS_SCHEMA}
    columns["kind"] = [getattr(kind, "value", kind) for kind in columns["kind"]]  # an EventKind, or its string
    frame = pl.DataFrame(columns, schema=_EVENTS_SCHEMA)
    return frame.sort("at_s", "event_id").with_columns(pl.lit(SCHEMA_VERSION, pl.Int64).alias("schema_version"))


class EventLogError(ValueError):
    """A lifecycle log that cannot be used; the message names what is wrong."""


_EXPORT_DTYPES = {
    "event_id": pl.String,
    "kind": pl.String,
    "at_s": pl.Float64,
    "trajectory_id": pl.String,
    "turn": pl.Int64,
    "task_family": pl.String,
    "step": pl.Int64,
    "new_tokens": pl.Int64,
    "cached_prefix_tokens": pl.Int64,
    "context_tokens": pl.Int64,
    "generated_tokens": pl.Int64,
    "duration_s": pl.Float64,
    "schema_version": pl.Int64,
}


def load_events(path: str | Path) -> pl.DataFrame:
    """Read an events.parquet written by `events_frame` and validate it: every column present,
    a schema version this code knows, no duplicate ids, rows in time order. Raises
    EventLogError naming the problem; out-of-order rows and duplicate ids are repaired
    (sorted by (at_s, event_id); duplicates dropped) with a logged note, since both are safe."""
    path = Path(path)
    try:
        frame = pl.read_parquet(path)
    except FileNotFoundError:
        raise EventLogError(f"{path}: no such event log") from None
    except (pl.exceptions.ComputeError, OSError) as err:
        raise EventLogError(f"{path}: not a Parquet event log: {err}") from None
    return check_events(frame, str(path))


def check_events(frame: pl.DataFrame, where: str = "event log") -> pl.DataFrame:
    missing = sorted((EVENT_COLUMNS | {"schema_version"}) - set(frame.columns))
    if missing:
        raise EventLogError(f"{where}: missing column(s) {', '.join(missing)}")
    versions = sorted(set(frame["schema_version"].drop_nulls().to_list()))
    unknown = [v for v in versions if v != SCHEMA_VERSION]
    if unknown or frame["schema_version"].null_count():
        raise EventLogError(f"{where}: schema_version {unknown or 'null'} is unknown (this code reads version {SCHEMA_VERSION})")
    for column, dtype in _EXPORT_DTYPES.items():
        if frame[column].dtype != dtype:
            raise EventLogError(f"{where}: column {column} has type {frame[column].dtype}, expected {dtype}")
    if frame["at_s"].null_count() or frame["kind"].null_count():
        raise EventLogError(f"{where}: null at_s or kind in {frame['at_s'].null_count() + frame['kind'].null_count()} row(s)")
    if frame["event_id"].n_unique() != frame.height:
        dropped = frame.height - frame["event_id"].n_unique()
        frame = frame.unique("event_id", keep="first", maintain_order=True)
        LOG.warning("%s: dropped %d duplicate event id(s)", where, dropped)
    ordered = frame.sort("at_s", "event_id")
    if not ordered["event_id"].equals(frame["event_id"]):
        LOG.warning("%s: rows were out of time order; sorted by (at_s, event_id)", where)
    return ordered
