"""The export (ops/export.py) on the real bus: a message in a stream that does not decode as
its subject's type is left out of the export, logged in one line, and counted in the run
record and the summary (`undecodable_messages`, `undecodable_by_subject`); the stream keeps it."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest

from actors.base.inproc import InProcServer
from bus_schemas import streams, subjects
from bus_schemas.codec import encode
from bus_schemas.eventlog import events_frame
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.work import PrefillWork
from ops.export import read_run, read_stream, summarize, write_run
from tests.test_engine_core import work

pytestmark = pytest.mark.bus


def event(event_id: str) -> LifecycleEvent:
    return LifecycleEvent(event_id=event_id, kind=EventKind.PREFILL_QUEUED, at_s=0.0, actor_id="t")


@pytest.fixture(params=["nats", "inproc"])
async def any_bus(request, bus):
    """The real bus, and the simulation's in-process one (whose export takes the stream's
    messages in one list, `InProcJetStream.stored_messages`)."""
    if request.param == "nats":
        yield bus
        return
    nc = InProcServer().connect("export-test")
    await streams.ensure_streams(nc.jetstream())
    yield nc


async def test_undecodable_messages_are_counted_logged_and_left_in_the_stream(any_bus, caplog, tmp_path: Path, tiny_config):
    js = any_bus.jetstream()
    lc = subjects.lifecycle(EventKind.PREFILL_QUEUED.value)
    for payload in [encode(event("a")), b"\x93\xff garbage", encode(event("b")), b"", encode(event("c"))]:
        await js.publish(lc, payload)  # the ack is the barrier: stored before the export reads
    await js.publish(subjects.train_finished(), b"not msgpack")
    await js.publish(subjects.train_step(), encode(event("a step report it is not")))  # decodes, wrong type

    with caplog.at_level(logging.ERROR, logger="prorsa.export"):
        record = await read_run(js)

    assert [e.event_id for e in record.events] == ["a", "b", "c"]
    assert record.finished == [] and record.steps == []
    assert record.undecodable == {lc: 2, subjects.train_finished(): 1, subjects.train_step(): 1}
    lines = [r.getMessage() for r in caplog.records if r.name == "prorsa.export"]
    assert len(lines) == 4, lines
    assert sum(lc in line and "LIFECYCLE" in line and "not a LifecycleEvent" in line for line in lines) == 2
    assert all("left out of the export" in line for line in lines)
    assert (await js.stream_info(streams.LIFECYCLE.name)).state.messages == 5  # reading took nothing out

    summary = summarize(record, events_frame(record.events), policy="colocated", mode="sync", backend="emulated", expected=0)
    assert summary["undecodable_messages"] == 4
    assert summary["undecodable_by_subject"] == {lc: 2, subjects.train_finished(): 1, subjects.train_step(): 1}

    out = tmp_path / "run"
    out.mkdir()
    written = write_run(record, out, tiny_config, "completed", 1.0)
    assert json.loads((out / "summary.json").read_text())["undecodable_messages"] == 4 == written["undecodable_messages"]


async def test_a_clean_run_reads_zero_undecodable(bus):
    js = bus.jetstream()
    await js.publish(subjects.lifecycle(EventKind.PREFILL_QUEUED.value), encode(event("a")))
    record = await read_run(js)
    assert record.undecodable == {}
    summary = summarize(record, events_frame(record.events), policy="colocated", mode="sync", backend="emulated", expected=0)
    assert summary["undecodable_messages"] == 0 and summary["undecodable_by_subject"] == {}


async def test_a_work_queue_read_counts_its_undecodable_messages_too(bus, caplog):
    """Work queues are read message by message (no second consumer): the same count and line."""
    js = bus.jetstream()
    await js.publish(subjects.work_prefill(), encode(work("a")))
    await js.publish(subjects.work_prefill(), b"\xc1")  # 0xc1: never valid msgpack
    await js.publish(subjects.work_prefill(), encode(work("b")))
    undecodable: Counter[str] = Counter()
    with caplog.at_level(logging.ERROR, logger="prorsa.export"):
        got = await read_stream(js, streams.WORK_PREFILL, subjects.work_prefill(), PrefillWork, undecodable)
    assert [w.trajectory_id for w in got] == ["a", "b"]
    assert undecodable == {subjects.work_prefill(): 1}
    assert [r.getMessage() for r in caplog.records if "message 2 of 3" in r.getMessage()] != []


def test_a_restarted_actors_counters_add_up_over_its_incarnations():
    """Each incarnation's last report counts (the final one, or the last checkpoint of a
    process that was killed); `max_*` counters take the largest; reports without
    incarnations (one process) count once, their last."""
    from bus_schemas.status import ActorReport
    from ops.export import actor_counters, incarnations

    def report(actor: str, incarnation: str, final: bool, **counters: int) -> ActorReport:
        return ActorReport(actor_id=actor, kind="engine", at_s=0.0, counters=counters, incarnation=incarnation, final=final)

    reports = [
        report("e0", "a", False, invalid_messages=1, max_tick_lag_ms=30),
        report("e0", "a", False, invalid_messages=4, max_tick_lag_ms=50),  # a's last word: it was killed
        report("e0", "b", False, invalid_messages=1),
        report("e0", "b", True, invalid_messages=2, max_tick_lag_ms=20, redelivered=3),
        report("e1", "", True, invalid_messages=9),
        report("e1", "", True, invalid_messages=10),  # the same process reporting twice: its last
    ]
    assert actor_counters(reports) == {
        "e0": {"invalid_messages": 6, "max_tick_lag_ms": 50, "redelivered": 3},
        "e1": {"invalid_messages": 10},
    }
    assert incarnations(reports) == {
        "e0": {"incarnations": 2, "without_final_report": 1},
        "e1": {"incarnations": 1, "without_final_report": 0},
    }


async def test_a_host_waits_for_final_reports_not_checkpoints(bus):
    """`ops.cluster.wait_for_reports`: an actor whose last report is a checkpoint is still
    missing; its final report ends the wait."""
    from bus_schemas.status import ActorReport
    from ops.cluster import wait_for_reports

    js = bus.jetstream()

    async def report(final: bool) -> None:
        r = ActorReport(actor_id="w0", kind="engine", at_s=1.0, counters={"n": 1}, incarnation="a", final=final)
        await js.publish(subjects.report("w0"), encode(r))  # acked: stored before the wait reads

    await report(final=False)
    assert await wait_for_reports(js, ["w0"], timeout_wall_s=0.3) == ["w0"]
    await report(final=True)
    assert await wait_for_reports(js, ["w0"], timeout_wall_s=5.0) == []


async def test_a_live_actor_checkpoints_its_counters_then_reports_final(bus, tiny_config):
    """A running actor publishes its counters as checkpoints (not final) when they change, and
    its final report last, all under one incarnation: what the export adds up after a kill."""
    import asyncio

    from actors.base.runtime import Actor
    from bus_schemas.codec import decode
    from bus_schemas.status import ActorReport
    from tests.actor_helpers import build

    js = bus.jetstream()
    actor = build(Actor, "ck0", tiny_config, bus)
    actor.report_checkpoint_wall_s = 0.05
    actor.counters["invalid_messages"] = 3
    running = asyncio.create_task(actor.run())
    try:
        async with asyncio.timeout(20):
            while True:  # barrier: the checkpoint is in the stream (a poll with a deadline)
                try:
                    last = decode(ActorReport, (await js.get_last_msg(streams.REPORTS.name, subjects.report("ck0"))).data)
                    break
                except Exception:  # not there yet
                    await asyncio.sleep(0.05)  # barrier-ok: a bounded poll of the stream; no event marks a stored report
    finally:
        actor.request_stop("test over")
        await asyncio.wait_for(running, 20)
    assert not last.final and last.counters["invalid_messages"] == 3 and last.incarnation == actor.incarnation
    final = decode(ActorReport, (await js.get_last_msg(streams.REPORTS.name, subjects.report("ck0"))).data)
    assert final.final and final.incarnation == actor.incarnation and final.counters["invalid_messages"] == 3
