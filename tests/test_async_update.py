"""A weight update mid-decode (run.mode = "async"), on the real bus: emulated engines in process,
a prefill and a decode engine; LoadPolicy(1) arrives while decodes run. No turn is lost, and
no engine serves or reuses KV of version 0 once it holds version 1."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.engine.actor import EngineActor
from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import CommandAck, LoadPolicy, Role
from bus_schemas.lifecycle import EventKind
from tests.actor_helpers import TurnWatch, at_scale, build, clock_for
from tests.test_engine_core import work

pytestmark = pytest.mark.bus

TURNS = 6
OUT = 1500  # tokens per turn: decodes run for seconds of wall time at 20x


def async_config(config, inflight: str):
    config = at_scale(config, 20.0)
    return msgspec.structs.replace(
        config,
        run=msgspec.structs.replace(config.run, mode="async"),
        engines=msgspec.structs.replace(config.engines, inflight_on_update=inflight),
    )


@pytest.mark.parametrize("inflight", ["finish", "interrupt"])
async def test_an_update_mid_decode_loses_no_turn_and_never_serves_old_kv(bus, tiny_config, inflight: str):
    config = async_config(tiny_config, inflight)
    clock = clock_for(config)
    prefill = build(EngineActor, "e0", config, bus, Role.PREFILL, clock=clock)
    decode_ = build(EngineActor, "e1", config, bus, Role.DECODE, clock=clock)
    watch = TurnWatch(2 * TURNS, decoding_on="e1")
    await watch.subscribe(bus, subjects.result_all())
    got, log, all_in, decoding = watch.got, watch.log, watch.all_in, watch.decoding
    js = bus.jetstream()
    for i in range(TURNS):
        await js.publish(subjects.work_prefill(), encode(work(f"old{i}-{inflight}", context=0, new=600, out=OUT)))
    runs = [asyncio.create_task(prefill.run()), asyncio.create_task(decode_.run())]
    try:
        await asyncio.wait_for(decoding.wait(), timeout=30)
        acks = await asyncio.gather(*(bus.request(subjects.ctl_policy(e), encode(LoadPolicy(version=1)), timeout=30) for e in ("e0", "e1")))
        assert all(decode(CommandAck, a.data).ok and decode(CommandAck, a.data).policy_version == 1 for a in acks)
        for i in range(TURNS):  # asked for version 0 after the update: run on 1
            await js.publish(subjects.work_prefill(), encode(work(f"new{i}-{inflight}", context=0, new=600, out=OUT)))
        await asyncio.wait_for(all_in.wait(), timeout=60)
        await bus.flush()
    finally:
        for engine in (prefill, decode_):
            engine.request_stop("test over")
        await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), timeout=30)
    # no turn lost: every turn answered once, with all its tokens
    old, new = (
        [f"old{i}-{inflight}" for i in range(TURNS)],
        [f"new{i}-{inflight}" for i in range(TURNS)],
    )  # ids unique per test: streams deduplicate them
    assert sorted(got) == sorted(old + new)
    assert all(r.output_tokens == OUT for r in got.values())
    assert all(got[t].policy_version == 1 for t in new)
    loaded_at = {e.engine_id: e.at_s for e in log if e.kind is EventKind.POLICY_LOADED and e.policy_version == 1}
    assert set(loaded_at) == {"e0", "e1"}
    # never old KV on an engine that holds the new version: every prefill, KV transfer and decode
    # there after the load ran on version 1
    for e in log:
        if (
            e.engine_id in loaded_at
            and e.at_s > loaded_at[e.engine_id]
            and e.kind
            in (
                EventKind.PREFILL_STARTED,
                EventKind.KV_TRANSFER_DONE,
                EventKind.DECODE_STARTED,
                EventKind.DECODE_DONE,
            )
        ):
            assert e.policy_version == 1, e
    for engine in (prefill, decode_):
        assert not engine.core.prefixes.entries_below(1)  # no prefix of version 0 stays cached
    if inflight == "interrupt":  # cut turns resumed on 1 with the tokens they had: recorded as spanning 0 -> 1
        cut = {e.trajectory_id for e in log if e.kind is EventKind.TURN_INTERRUPTED}
        assert cut and all(got[t].policy_version == 1 and got[t].oldest_policy_version == 0 for t in cut)
        assert all(e.generated_tokens > 0 for e in log if e.kind is EventKind.TURN_INTERRUPTED and e.engine_id == "e1")
    else:  # in-flight turns finished on 0 before the engine loaded 1
        assert all(got[t].oldest_policy_version == -1 for t in old)
        decoded_old = [e for e in log if e.kind is EventKind.DECODE_DONE and e.trajectory_id.startswith("old")]
        assert all(e.at_s <= loaded_at["e1"] or e.policy_version == 1 for e in decoded_old)
