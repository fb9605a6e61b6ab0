"""Bad input on every subject an actor consumes, during a real `ops.launch` run (prorsa: the
forecaster, the allocator and per-turn routing all live): random bytes, truncated msgpack of
each schema, wrong-typed fields and an older layout (a required field missing) are each
rejected and counted exactly once per actor that receives them; an oversize payload is
refused by the server; no actor exits, heartbeats continue, nothing is lost."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import nats
import pytest

from actors.base.connection import close, connect
from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import Command, CommandAck
from bus_schemas.forecast import DemandForecast
from bus_schemas.lifecycle import LifecycleEvent
from bus_schemas.status import ActorStatus, EngineStatus
from bus_schemas.train import FinishedTrajectory, TaskAssignment
from bus_schemas.work import DecodeWork, KvChunk, KvFetch, PrefillWork, TurnResult
from ops.natsserver import MAX_PAYLOAD_BYTES
from tests.conftest import write_tiny_config
from tests.test_faults_restart import FAST_PD_ALLOCATOR, launch_with_fault, wait_for_allocator_deciding, wait_for_event
from tests.test_launch import assert_all_gone

pytestmark = pytest.mark.e2e

# subject -> (schema, how many actors receive and count each message there)
STORED = {  # JetStream work and logs: one consumer takes each message
    subjects.work_prefill(): (PrefillWork, 1),
    subjects.work_prefill("e0"): (PrefillWork, 1),
    subjects.work_decode(): (DecodeWork, 1),
    subjects.result("env0"): (TurnResult, 1),
    subjects.train_tasks(): (TaskAssignment, 1),
    subjects.train_finished(): (FinishedTrajectory, 1),
    subjects.lifecycle("prefill_done"): (LifecycleEvent, 1),  # the forecaster
}
CORE = {  # pub/sub: every subscriber counts
    subjects.status("engine", "e0"): (EngineStatus, 2),  # the allocator and the environment's router
    subjects.status("environment", "env0"): (ActorStatus, 1),  # the allocator
    subjects.forecast(): (DemandForecast, 1),  # the allocator
}
REQUESTS = {subjects.ctl_engine("e0"): (Command, CommandAck), subjects.kv("e0"): (KvFetch, KvChunk)}  # each answered


def sample(t):
    """A minimal valid value of msgspec type info `t` (required fields only)."""
    match t:
        case mi.StrType():
            return "x"
        case mi.BoolType():
            return False
        case mi.IntType():
            return 1
        case mi.FloatType():
            return 1.0
        case mi.EnumType():
            return next(iter(t.cls)).value
        case mi.LiteralType():
            return t.values[0]
        case mi.ListType() | mi.TupleType() | mi.VarTupleType() | mi.SetType() | mi.FrozenSetType():
            return []
        case mi.DictType():
            return {}
        case mi.UnionType():
            return sample(next((x for x in t.types if not isinstance(x, mi.NoneType)), t.types[0]))
        case mi.StructType():
            fields = {f.encode_name: sample(f.type) for f in t.fields if f.required}
            return fields | ({t.tag_field: t.tag} if t.tag_field else {})
    raise TypeError(f"no sample for {t}")


def bad_payloads(schema, rng: random.Random) -> dict[str, bytes]:
    """Four broken versions of a message of `schema`; each fails to decode as `schema`."""
    valid = sample(mi.type_info(schema))
    tag = mi.type_info(schema).tag_field if isinstance(mi.type_info(schema), mi.StructType) else "type"
    whole = encode(msgspec.convert(valid, schema))
    dropped = next(k for k in valid if k != tag)
    payloads = {
        "random bytes": rng.randbytes(64),
        "truncated": whole[: len(whole) // 2],
        "wrong types": msgspec.msgpack.encode({k: (v if k == tag else [[1.5]]) for k, v in valid.items()}),
        "older layout": msgspec.msgpack.encode({k: v for k, v in valid.items() if k != dropped}),
    }
    for _what, data in payloads.items():
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            decode(schema, data)  # the test's own check: each really is bad input
    return payloads


async def vandalize(out: Path, rng: random.Random) -> set[str]:
    """Send every bad payload as the launcher's (all-powerful) user; return which actors then
    sent a heartbeat (they were all still alive after it)."""
    creds = json.loads((out / "credentials" / "launcher.json").read_text())
    url = json.loads((out / "bus.json").read_text())["url"]
    nc = await connect(url, "vandal", __import__("logging").getLogger("test"), user=creds["user"], password=creds["password"])
    try:
        js = nc.jetstream()
        for subject, (schema, _) in STORED.items():
            for data in bad_payloads(schema, rng).values():
                await js.publish(subject, data)
        for subject, (schema, _) in CORE.items():
            for data in bad_payloads(schema, rng).values():
                await nc.publish(subject, data)
        for subject, (schema, reply_type) in REQUESTS.items():
            for data in bad_payloads(schema, rng).values():
                reply = decode(reply_type, (await nc.request(subject, data, timeout=10)).data)
                assert not reply.ok and "malformed" in reply.error  # answered, refused, still serving
        with pytest.raises(nats.errors.MaxPayloadError):
            await nc.publish(subjects.work_prefill(), b"\x00" * (MAX_PAYLOAD_BYTES + 1))
        await nc.flush()
        alive: set[str] = set()
        wanted = {"e0", "e1", "env0", "allocator", "trainer"}
        done = asyncio.Event()

        async def on_status(msg) -> None:
            alive.add(msg.subject.rsplit(".", 1)[-1])
            if wanted <= alive:
                done.set()

        await nc.subscribe(subjects.status_all(), cb=on_status)
        await asyncio.wait_for(done.wait(), timeout=30)  # heartbeats after all of it, from every actor that sends them
        return alive
    finally:
        await close(nc)


async def every_actor_serving(bus: Path) -> None:
    """Decode has begun on e0 and the allocator has decided once, so its subscriptions are live:
    core pub/sub reaches only subscribers already there, and a loaded machine may start the
    allocator after the engines and the environment are serving."""
    await wait_for_event(bus, "decode_started", "e0", 0, timeout_wall_s=60)
    await wait_for_allocator_deciding(bus, timeout_wall_s=120)


def test_bad_input_on_every_subject_is_rejected_counted_and_nothing_stops(tmp_path: Path):
    # steps: the garbage lands after the allocator's first decision; a step to spare after it
    # lets every consumer pull what was stored before the run ends, on a slow machine too
    config = write_tiny_config(tmp_path / "tiny.toml", policy="prorsa", steps=3, time_scale=10.0)
    config.write_text(config.read_text() + FAST_PD_ALLOCATOR)
    out = tmp_path / "run"
    pids, output, returncode = launch_with_fault(
        config,
        out,
        every_actor_serving,
        lambda pids: asyncio.run(vandalize(out, random.Random(16))),
    )
    assert returncode == 0, output
    assert_all_gone(pids)
    summary = json.loads((out / "summary.json").read_text())
    expected = 4 * (sum(n for _, n in STORED.values()) + sum(n for _, n in CORE.values()) + len(REQUESTS))
    per_actor = {a: c.get("invalid_messages", 0) for a, c in summary["actors"].items()}
    assert summary["invalid_messages"] == expected, per_actor
    assert summary["restarts"] == {} and summary["actor_deaths"] == []  # no actor exited
    assert summary["status"] == "completed" and summary["trajectories_lost"] == 0 and summary["incomplete_trajectories"] == 0
    assert summary["trajectories_finished"] == summary["trajectories_expected"] and summary["dead_letters"] == 0
