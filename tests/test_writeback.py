"""KV write-back from decode to the prefill side (`engines.kv_writeback`), emulated backend:
the core's prefix extension, the store tier's index, the router's cost, and on the real bus
the next turn's prefill computing only what the write-back did not bring."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from actors.base.clock import ScaledClock
from actors.engine.actor import EngineActor
from actors.engine.core import EngineCore
from actors.engine.writeback import StoreIndex
from actors.environment.router import Router, store_miss_share
from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import Role
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.status import EngineStatus
from bus_schemas.work import DecodeWork, KvHandle, TurnResult
from tests.test_engine_core import PRESET, work

BYTES_PER_TOKEN = PRESET.kv_bytes_per_token


# --- pure: the core's prefix extension ---------------------------------------------------------
def prefill_core() -> EngineCore:
    return EngineCore("e0", Role.PREFILL, PRESET, 2048, 16, 8)


def test_extend_prefix_grows_a_cached_prefix_and_refuses_when_it_moved_on():
    c = prefill_core()
    c._cache_put("a", 0, 800)
    assert c.extend_prefix("a", 0, 800, 819) and c.cached_prefix("a", 0) == 819
    assert not c.extend_prefix("a", 0, 800, 819)  # holds it already
    assert not c.extend_prefix("a", 1, 0, 50) or c.cached_prefix("a", 1) == 50  # another version: its own entry
    c.prefixes.take("a", 0)  # the next turn was admitted: its prefix left the cache
    assert not c.extend_prefix("a", 0, 800, 900) and c.cached_prefix("a", 0) == 0
    seq = c.admit_prefill(work("b", context=0, new=100))
    assert c.in_flight("b") and not c.extend_prefix("b", 0, 0, 500)  # never under a turn in flight
    assert seq.cached_prefix_tokens == 0


def test_extend_prefix_takes_its_room_from_older_cache_entries():
    c = prefill_core()
    capacity = c.kv_capacity_tokens
    c._cache_put("old", 0, capacity // 2)
    c._cache_put("a", 0, 100)
    assert c.extend_prefix("a", 0, 100, capacity // 2 + 200)
    assert c.cached_prefix("old", 0) == 0 and c.cached_tokens == capacity // 2 + 200  # LRU eviction


def test_store_index_evicts_the_oldest_written_under_its_capacity():
    store = StoreIndex(1000)
    store.put("a", 0, 400)
    store.put("b", 0, 400)
    store.put("a", 0, 500)  # a rewrite is the newest again
    assert (store.get("a", 0), store.get("b", 0), store.tokens) == (500, 400, 900)
    store.put("c", 0, 300)
    assert (store.get("b", 0), store.get("a", 0), store.get("c", 0), store.evicted) == (0, 500, 300, 1)
    store.put("huge", 0, 2000)  # larger than the tier: not stored, nothing else lost
    assert store.get("huge", 0) == 0 and store.tokens == 800


# --- pure: the router ----------------------------------------------------------------------------
def status(engine_id: str, role: Role, waiting_tokens: int = 0) -> EngineStatus:
    return EngineStatus(
        engine_id=engine_id,
        at_s=0,
        role=role,
        epoch=0,
        policy_version=0,
        backend="emulated",
        waiting_prefill=0,
        running_decode=0,
        kv_used_tokens=0,
        kv_capacity_tokens=1,
        held_kv_handles=0,
        busy_fraction=0.0,
        waiting_prefill_tokens=waiting_tokens,
    )


def _fleet(router: Router) -> Router:
    for engine_id, role in (("p0", Role.PREFILL), ("p1", Role.PREFILL), ("d0", Role.DECODE)):
        router.observe(status(engine_id, role))
    return router


def test_with_write_back_an_append_small_against_its_context_goes_to_the_prefill_engine():
    # 2000 new tokens on 30000 of context: without write-back the prefill engine would
    # recompute the last output, so it stays on the decode engine; with it, it goes home to p0
    assert _fleet(Router(["p0", "p1", "d0"], 1024)).route("d0", "p0", 30_000, 2000) == "d0"
    assert _fleet(Router(["p0", "p1", "d0"], 1024, writeback="to-prefill")).route("d0", "p0", 30_000, 2000) == "p0"
    # a really short append still stays where all the KV is, no transfer
    assert _fleet(Router(["p0", "p1", "d0"], 1024, writeback="to-prefill")).route("d0", "p0", 30_000, 500) == "d0"


def test_with_a_store_tier_a_loaded_home_loses_to_an_idle_engine_sooner():
    def with_backlog(router: Router) -> Router:
        router.observe(status("p0", Role.PREFILL, 12_000))
        return router

    ids = ["p0", "p1", "d0"]
    # the home p0 is 12k tokens behind p1; a miss elsewhere costs the 16k context recomputed
    # (to-prefill: stay home), or loaded from the store at a fraction of that (go to p1)
    assert with_backlog(_fleet(Router(ids, 1024, writeback="to-prefill"))).route("d0", "p0", 16_000, 4000) == "p0"
    share = 0.5
    assert with_backlog(_fleet(Router(ids, 1024, writeback="store", miss_share=share))).route("d0", "p0", 16_000, 4000) == "p1"


def test_store_miss_share_comes_from_the_cost_model(tiny_config):
    engines = msgspec.structs.replace(tiny_config.engines, kv_writeback="store")
    share = store_miss_share(engines)
    assert 0 < share < 1  # loading 8B KV at 6 GB/s beats recomputing it on an H100, but is not free
    faster = msgspec.structs.replace(engines, kv_store_link="rdma-8x400g")
    assert store_miss_share(faster) < share


# --- on the real bus ---------------------------------------------------------------------------
pytest_bus = pytest.mark.bus


def with_writeback(config, mode: str):
    return msgspec.structs.replace(config, engines=msgspec.structs.replace(config.engines, kv_writeback=mode))


def with_local_appends(config):
    """A policy with decode engines prefilling the short appends routed to them (`static`)."""
    engines = msgspec.structs.replace(config.engines, kv_writeback="to-prefill", local_prefill_max_tokens=1024)
    return msgspec.structs.replace(config, run=msgspec.structs.replace(config.run, policy="static"), engines=engines)


def engine(bus, config, engine_id: str, role: Role) -> EngineActor:
    return EngineActor(engine_id, config, bus, ScaledClock(100.0, time.time()), role)


class Watch:
    """Turn results and lifecycle events of some kinds as they are published (core subscriptions:
    the barrier is the message itself, no sleeps)."""

    def __init__(self) -> None:
        self.results: list[TurnResult] = []
        self.events: list[LifecycleEvent] = []
        self.changed = asyncio.Event()

    async def start(self, bus, *kinds: EventKind) -> None:
        await bus.subscribe(subjects.result("env0"), cb=self._on_result)
        for kind in kinds:
            await bus.subscribe(subjects.lifecycle(kind.value), cb=self._on_event)
        await bus.flush()

    async def _on_result(self, msg) -> None:
        self.results.append(decode(TurnResult, msg.data))
        self.changed.set()

    async def _on_event(self, msg) -> None:
        self.events.append(decode(LifecycleEvent, msg.data))
        self.changed.set()

    def of(self, kind: EventKind, trajectory_id: str, turn: int) -> list[LifecycleEvent]:
        return [e for e in self.events if e.kind is kind and e.trajectory_id == trajectory_id and e.turn == turn]

    async def until(self, condition, timeout: float = 30) -> None:
        async def loop():
            while not condition():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(loop(), timeout)


async def _turns(bus, config, traj: str, turns, kinds=(EventKind.PREFILL_DONE, EventKind.KV_WRITEBACK_DONE)):
    """Engines e0 (prefill) and e1 (decode). Each of `turns`, (queue, work, written back), is
    published on that engine's own queue (None: the shared one) once the turn before has its
    result and, where it is written back, its write-back landed. Returns the watch and the
    engines (stopped)."""
    watch = Watch()
    await watch.start(bus, *kinds)
    e0, e1 = engine(bus, config, "e0", Role.PREFILL), engine(bus, config, "e1", Role.DECODE)
    running = [asyncio.create_task(e0.run()), asyncio.create_task(e1.run())]
    js = bus.jetstream()
    try:
        await asyncio.wait_for(asyncio.gather(e0.ready.wait(), e1.ready.wait()), timeout=10)
        for done, (queue, turn_work, written_back) in enumerate(turns, start=1):
            await js.publish(subjects.work_prefill(queue), encode(turn_work))
            await watch.until(lambda done=done: len(watch.results) == done)
            if written_back:
                await watch.until(lambda turn=turn_work.turn: watch.of(EventKind.KV_WRITEBACK_DONE, traj, turn))
    finally:
        for e in (e0, e1):
            e.request_stop("test over")
        await asyncio.wait_for(asyncio.gather(*running), timeout=15)
    return watch, e0, e1


async def _two_turns(bus, config, traj: str):
    """Turn 0 prefilled on e0, decoded on e1; then turn 1 (its whole history as context) on e0."""
    written_back = config.engines.kv_writeback != "none"
    turns = [(None, work(traj, context=0, new=800, out=20), written_back), (None, work(traj, turn=1, context=820, new=100, out=5), False)]
    return await _turns(bus, config, traj, turns)


@pytest_bus
async def test_without_write_back_the_prefill_engine_recomputes_the_last_output(bus, tiny_config):
    watch, e0, e1 = await _two_turns(bus, with_writeback(tiny_config, "none"), "nowb")
    [turn1] = watch.of(EventKind.PREFILL_DONE, "nowb", 1)
    assert turn1.cached_prefix_tokens == 800  # only the prompt it prefilled itself
    assert not watch.of(EventKind.KV_WRITEBACK_DONE, "nowb", 0) and not e1._writebacks


@pytest_bus
async def test_written_back_output_makes_the_next_prefill_compute_only_the_new_tokens(bus, tiny_config):
    watch, e0, e1 = await _two_turns(bus, with_writeback(tiny_config, "to-prefill"), "wb")
    [landed] = watch.of(EventKind.KV_WRITEBACK_DONE, "wb", 0)
    # e0 held the 800-token prompt; the 20 generated tokens less the last one (no KV yet) came back
    assert (landed.engine_id, landed.cached_prefix_tokens, landed.new_tokens) == ("e0", 819, 19)
    assert landed.kv_bytes == 19 * BYTES_PER_TOKEN and landed.duration_s > 0 and landed.detail == "to-prefill from e1"
    [turn1] = watch.of(EventKind.PREFILL_DONE, "wb", 1)
    assert turn1.cached_prefix_tokens == 819  # computes the last sampled token and the 100 new ones
    assert e0.counters["kv_writeback_landed"] >= 1 and e1.counters["kv_writeback_served"] >= 1
    assert e1.counters["kv_writeback_held"] == 2  # turn 1's output is held for e0 too


@pytest_bus
async def test_a_short_append_its_decode_engine_prefilled_is_written_back_to_the_prefix_holder(bus, tiny_config):
    """Turn 1, a short append, is prefilled and decoded on e1, where its KV is; it names e0, the
    prefill engine holding the prefix, as its write-back target. e0 then holds the whole
    context, and turn 2, a long one, computes only its own tokens there."""
    traj = "local"
    append = msgspec.structs.replace(work(traj, turn=1, context=820, new=30, out=10), writeback_engine_id="e0")
    turns = [
        (None, work(traj, context=0, new=800, out=20), True),
        ("e1", append, True),
        (None, work(traj, turn=2, context=860, new=900, out=5), False),
    ]
    watch, e0, e1 = await _turns(bus, with_local_appends(tiny_config), traj, turns)
    [local] = watch.of(EventKind.PREFILL_DONE, traj, 1)
    assert local.engine_id == "e1" and local.cached_prefix_tokens == 820  # prefilled where its KV was
    [landed] = watch.of(EventKind.KV_WRITEBACK_DONE, traj, 1)
    # e0 held 819 (turn 0's write-back); the append, its output less the last token came back
    assert (landed.engine_id, landed.cached_prefix_tokens, landed.new_tokens) == ("e0", 859, 40)
    [long] = watch.of(EventKind.PREFILL_DONE, traj, 2)
    assert (long.engine_id, long.cached_prefix_tokens) == ("e0", 859)


@pytest_bus
async def test_a_short_append_without_a_write_back_target_leaves_the_prefix_holder_behind(bus, tiny_config):
    traj = "stale"
    turns = [
        (None, work(traj, context=0, new=800, out=20), True),
        ("e1", work(traj, turn=1, context=820, new=30, out=10), False),
        (None, work(traj, turn=2, context=860, new=900, out=5), False),
    ]
    watch, e0, e1 = await _turns(bus, with_local_appends(tiny_config), traj, turns)
    assert not watch.of(EventKind.KV_WRITEBACK_DONE, traj, 1) and e1.counters["kv_writeback_held"] == 2  # turns 0 and 2 only
    [long] = watch.of(EventKind.PREFILL_DONE, traj, 2)
    assert (long.engine_id, long.cached_prefix_tokens) == ("e0", 819)  # recomputes the append and its output


@pytest_bus
async def test_a_notice_nobody_acks_is_counted_and_the_turn_still_returns(bus, tiny_config):
    config = with_writeback(tiny_config, "to-prefill")
    watch = Watch()
    await watch.start(bus)
    w = work("orphanwb", context=0, new=300, out=8)
    # a prefilled turn whose prefill engine "gone" never answers (its KV holder here is a stub)
    handle = KvHandle(engine_id="stub", handle_id=w.work_id, tokens=300, kv_bytes=300 * BYTES_PER_TOKEN, expires_at_s=1e9)

    async def stub_holder(msg) -> None:
        from bus_schemas.work import KvChunk

        await msg.respond(encode(KvChunk(handle_id=w.work_id, ok=True, tokens=300, kv_bytes=300 * BYTES_PER_TOKEN)))

    await bus.subscribe(subjects.kv("stub"), cb=stub_holder)
    item = DecodeWork(prefill=w, kv=handle, prefilled_at_s=0.0)
    await bus.jetstream().publish(subjects.work_decode(), encode(item))
    e1 = engine(bus, config, "e1", Role.DECODE)
    running = asyncio.create_task(e1.run())
    try:
        await watch.until(lambda: len(watch.results) == 1)
        for _ in range(200):  # the notice's no-responders answer arrives right after the result
            if e1.counters["kv_writeback_unacked"]:
                break
            await asyncio.sleep(0.01)  # barrier-ok: polls a counter set by a request's failure
    finally:
        e1.request_stop("test over")
        await asyncio.wait_for(running, timeout=15)
    assert watch.results[0].trajectory_id == "orphanwb" and watch.results[0].output_tokens == 8
    assert e1.counters["kv_writeback_unacked"] == 1 and not e1._writebacks  # counted, logged, nothing held


@pytest_bus
async def test_a_store_tier_serves_the_prefix_to_another_prefill_engine(bus, tiny_config):
    config = with_writeback(tiny_config, "store")
    watch = Watch()
    await watch.start(bus, EventKind.PREFILL_DONE, EventKind.KV_WRITEBACK_DONE, EventKind.KV_STORE_LOADED)
    e0, e1, e2 = engine(bus, config, "e0", Role.PREFILL), engine(bus, config, "e1", Role.DECODE), engine(bus, config, "e2", Role.PREFILL)
    e2._pulling = False  # turn 0 goes to e0, turn 1 to e2, which never saw the trajectory
    running = [asyncio.create_task(e.run()) for e in (e0, e1, e2)]
    js = bus.jetstream()
    try:
        await asyncio.wait_for(asyncio.gather(e0.ready.wait(), e1.ready.wait(), e2.ready.wait()), timeout=10)
        await js.publish(subjects.work_prefill(), encode(work("st", context=0, new=800, out=20)))
        await watch.until(lambda: len(watch.results) == 1 and watch.of(EventKind.KV_WRITEBACK_DONE, "st", 0))
        await bus.flush()
        e0._pulling, e2._pulling = False, True
        e0._roles_changed.set()
        e2._roles_changed.set()
        await js.publish(subjects.work_prefill(), encode(work("st", turn=1, context=820, new=100, out=5)))
        await watch.until(lambda: len(watch.results) == 2)
    finally:
        for e in (e0, e1, e2):
            e.request_stop("test over")
        await asyncio.wait_for(asyncio.gather(*running), timeout=15)
    [written] = watch.of(EventKind.KV_WRITEBACK_DONE, "st", 0)
    assert (written.engine_id, written.detail, written.kv_bytes) == ("e1", "store", 819 * BYTES_PER_TOKEN)
    [loaded] = watch.of(EventKind.KV_STORE_LOADED, "st", 1)
    assert (loaded.engine_id, loaded.cached_prefix_tokens, loaded.kv_bytes) == ("e2", 819, 819 * BYTES_PER_TOKEN)
    [turn1] = watch.of(EventKind.PREFILL_DONE, "st", 1)
    assert (turn1.engine_id, turn1.cached_prefix_tokens) == ("e2", 819)
    assert e2.store.get("st", 0) >= 819 and e2.counters["kv_store_loads"] == 1
