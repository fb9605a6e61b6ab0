"""The engine's bus adapter: pulls work for its role and drives the scheduler core in model
time; effects and KV moves are in `actors.engine.handoff`, commands in `actors.engine.commands`.

Work messages stay un-acked until their effect is durable (a decode work item, or a turn
result, stored in its stream), so an engine that dies loses nothing: JetStream redelivers.
"""

from __future__ import annotations

import asyncio

import msgspec
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from actors.base import Actor
from actors.base.flag import Flag
from actors.base.publish import pull_one
from actors.engine.backend import Backend
from actors.engine.commands import EngineCommands
from actors.engine.core import EngineCore, Seq
from actors.engine.emulated.backend import EmulatedBackend
from actors.engine.emulated.costmodel import LINKS
from actors.engine.handoff import EngineHandoff
from actors.engine.writeback import EngineWriteback
from bus_schemas import subjects
from bus_schemas.codec import decode
from bus_schemas.control import Role
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.status import EngineStatus
from bus_schemas.streams import LIFECYCLE, affinity_consumer, decode_consumer, prefill_consumer, pull_subscription
from bus_schemas.work import DecodeWork, PrefillWork

FETCH_WAIT_WALL_S = 0.2  # a pull request lasts this long (it returns as soon as a message is there)
IDLE_WAKE_WALL_S = 0.1  # a full engine looks for room again after this at the latest
GATE_POLL_S = 0.1  # model s: a prefill engine held back by a full decode side looks again after this (a few decode steps)
IDLE_SAFETY_WALL_S = 1.0  # an idle scheduler looks again after this even if nothing woke it
EXPIRY_SLACK_S = 1e-3  # held KV counts as expired once past its time: look just after it
MAX_LAG_WALL_S = 0.02  # the engine's model-time cursor may trail the clock by this much


class EngineActor(EngineCommands, EngineHandoff, EngineWriteback, Actor):
    kind = "engine"
    migrates_decodes = True  # a switch may hand in-flight decodes to another engine at its deadline

    def __init__(self, actor_id, config, nc, clock, role: Role) -> None:
        super().__init__(actor_id, config, nc, clock)
        ec = config.engines
        self.link = LINKS[ec.link]
        runs, prior = ec.engine_presets(role, actor_id)
        self.core = EngineCore(
            actor_id,
            role,
            runs,
            ec.max_batch_tokens,
            ec.max_decode_seqs,
            ec.max_waiting,
            ec.admission,
            host_kv_ratio=ec.host_kv_ratio if ec.host_kv_tier else 0.0,
            divide_chunk=ec.dp_chunk == "divided",
            prefill_delayer=ec.prefill_delayer,
            prior=prior,
        )
        self._wake = Flag()  # new work admitted (or a stop requested)
        self.backend: Backend = EmulatedBackend(clock, self._wake)  # TorchEngineActor replaces it
        self.epoch = 0
        self.policy_version = 0
        self._msgs: dict[str, Msg] = {}  # work key -> the JetStream message to ack when done
        self._pending_transfers = 0
        self._effects = 0  # result / decode-work publishes in flight
        self._room = Flag()  # capacity freed
        self._progress = Flag()  # a step or transfer finished
        self._pulling = True
        self._roles_changed = Flag()  # a switch began or ended (or a stop): fetch loops look again
        self._queue_empty = {"prefill": False, "decode": False}  # the last pull found nothing
        self._last_heartbeat = (0.0, 0.0)  # (model time, busy time)
        self.switching = False
        self.role_since_s = 0.0
        # longest decode-only step in model seconds (None: the config's wall quantum x the time
        # scale); virtual time sets it high, steps then end at the next finish or new work
        self.max_decode_step_s: float | None = None
        self.prefilled_tokens_total = 0
        self.decoded_tokens_total = 0
        self.target_role = role  # the role the latest accepted SetRole asked for
        self._switched = asyncio.Event()  # set while no switch is under way
        self._switched.set()
        self._init_writeback()  # engines.kv_writeback: held write-backs, the store tier's index
        self.incarnation = ""  # set at setup, renewed after a lease lapse (EngineStatus.incarnation)
        self._init_updates()  # run.mode = "async": weight updates mid-rollout (commands.py)

    # --- setup and serving ---------------------------------------------------------------
    async def setup(self) -> None:
        ack_wait = self.clock.loop_s(self.config.run.ack_wait_wall_s)  # as the keep-alive's period
        max_deliver = self.config.run.max_deliver
        self._subs = {
            "prefill": await pull_subscription(self.js, prefill_consumer(), ack_wait, max_deliver),
            "decode": await pull_subscription(self.js, decode_consumer(), ack_wait, max_deliver),
        }
        if self.config.affinity_routing:
            self._subs["affinity"] = await pull_subscription(self.js, affinity_consumer(self.actor_id), ack_wait, max_deliver)
        await self.nc.subscribe(subjects.ctl_engine(self.actor_id), cb=self._on_role_command)
        await self.nc.subscribe(subjects.ctl_policy(self.actor_id), cb=self._on_policy_command)
        await self.nc.subscribe(subjects.kv(self.actor_id), cb=self._on_kv_fetch)
        await self._setup_writeback()
        await self._catch_up_policy()
        self.incarnation = self.new_id()[:8]
        self.log.info("engine up: role=%s preset=%s incarnation=%s", self.core.role.value, self.core.preset.name, self.incarnation)

    def on_lease_lapsed(self) -> None:
        self.incarnation = self.new_id()[:8]  # the fleet counted us out: register again

    async def _catch_up_policy(self) -> None:
        """An engine (re)started mid-run loads the latest published policy version, so it can
        take the step's work at once instead of waiting for the next LoadPolicy. (The
        in-process bus has no last-by-subject lookup; simulated engines never restart.)"""
        get_last_msg = getattr(self.js, "get_last_msg", None)
        if get_last_msg is None:
            return
        try:  # the lifecycle log, not the TRAIN stream: engines may not read trajectories (ops/access.py)
            msg = await get_last_msg(LIFECYCLE.name, subjects.lifecycle(EventKind.POLICY_PUBLISHED.value))
        except NotFoundError:
            return  # no version published yet: the trainer's LoadPolicy comes
        version = decode(LifecycleEvent, msg.data).policy_version
        if version > self.policy_version:
            error = await self._load_weights(version)
            if error is not None:
                raise RuntimeError(f"could not load policy {version} at start: {error}")
            self.policy_version = version
            self.counters["policy_caught_up"] += 1
            self.log.info("caught up to policy %d at start", version)

    async def serve(self, burst: bool) -> None:
        for queue in ("prefill", "decode"):
            self.spawn(self._fetch_loop(queue), f"fetch-{queue}")
        if "affinity" in self._subs:
            self.spawn(self._affinity_loop(), "fetch-affinity")
        self.spawn(self._keep_alive(), "in-progress")
        await self._step_loop(burst)

    async def teardown(self) -> None:
        for key, msg in list(self._msgs.items()):
            self.counters["returned_on_shutdown"] += 1
            with self.counting_bus_errors("nak_failures"):
                await msg.nak()
            del self._msgs[key]

    def _drained(self) -> bool:
        return self.core.idle and self._pending_transfers == 0 and self._effects == 0

    # --- pulling work --------------------------------------------------------------------
    def _queues(self) -> tuple[str, ...]:
        """The shared queues this engine's role pulls from."""
        role = self.core.role
        if role is Role.PREFILL:
            return ("prefill",)
        if role is Role.DECODE:
            return ("decode",)
        # colocated: in a fleet whose roles change, it also takes prefilled turns from prefill engines
        return ("prefill", "decode") if self.config.runs_allocator else ("prefill",)

    def _prefills_routed_turns(self) -> bool:
        """Does this engine prefill the turns routed to it (its own queue)?"""
        return self.core.role is not Role.DECODE or self.config.local_prefill_max_tokens > 0

    async def _fetch_loop(self, queue: str) -> None:
        while not self.stopping.is_set():
            if not (self._pulling and queue in self._queues()) or self._updating:
                self._roles_changed.clear()
                await self._roles_changed.wait()  # set by every switch, drain and stop
                continue
            if not self.core.has_room(self._pending_transfers):
                self._room.clear()
                await self._room.wait(self.clock.loop_s(IDLE_WAKE_WALL_S))
                continue
            msg = await pull_one(self._subs[queue], self.clock.loop_s(FETCH_WAIT_WALL_S))
            self._queue_empty[queue] = msg is None
            if msg is not None:
                await self._admit(msg, queue)
                self._wake.set()  # new work: a running decode step ends early so it can join

    async def _affinity_loop(self) -> None:
        """Turns routed here because this engine holds their prefix: prefilled here while the
        role takes them (prefill and colocated; decode too, under per-turn placement);
        otherwise (or during a switch) forwarded to the shared prefill queue, so a turn never
        waits on an engine that will not serve it."""
        sub = self._subs["affinity"]
        while not self.stopping.is_set():
            if self._updating:  # a weight update under way: routed turns wait here for the new version
                self._roles_changed.clear()
                await self._roles_changed.wait()
                continue
            serving = self._pulling and self._prefills_routed_turns()
            if serving and not self.core.has_room(self._pending_transfers):
                self._room.clear()
                await self._room.wait(self.clock.loop_s(IDLE_WAKE_WALL_S))
                continue
            msg = await pull_one(sub, self.clock.loop_s(FETCH_WAIT_WALL_S))
            if msg is None:
                continue
            if self._pulling and self._prefills_routed_turns():
                await self._admit(msg, "affinity")
                self._wake.set()
                continue
            work = await self.decode_work(PrefillWork, msg)
            if work is not None:
                self.counters["affinity_forwarded"] += 1
                await self._publish(subjects.work_prefill(), msg.data, f"{work.work_id}/fwd")
                await msg.ack()

    async def _decode_side_full(self) -> bool:
        """engines.admission = "sglang": SGLang's PD prefill engine computes a turn only once a
        decode engine has pre-allocated its KV (the bootstrap handshake). Here: no new hand-off
        prefill starts while the decode side asks for no work — no decode engine has a pull
        request waiting (one pulls only while it has room) or prefilled turns wait that none
        has taken. Those turns wait in this engine's queue (`EngineCore.hold_new_handoffs`,
        SGLang's bootstrap queue), and it looks again after GATE_POLL_S. Without it, KV the
        decode side cannot take sits held until `kv_ttl_s`, expires, and is computed again."""
        if self.core.role is not Role.PREFILL or self.core.admission != "sglang" or not self.core.waiting:
            return False
        with self.counting_bus_errors("gate_check_failures"):
            info = await self._subs["decode"].consumer_info()
            if (info.num_pending or 0) > 0 or (info.num_waiting or 0) == 0:
                self.counters["prefill_gated"] += 1
                return True
        return False

    async def _admit(self, msg: Msg, queue: str) -> None:
        if queue in ("prefill", "affinity"):
            work = await self.decode_work(PrefillWork, msg)
            if work is None:
                return
            if self.core.holds(work.work_id) or work.work_id in self._loading:  # redelivered while still in flight here
                self._msgs[work.work_id] = msg
                self.counters["redelivered_in_flight"] += 1
                return
            if work.policy_version > self.policy_version or not self._pulling or self._updating or not self._takes_prefill(queue):
                self.counters["returned_not_ready"] += 1
                await msg.nak(delay=0.1)
                return
            work = self._stamp(work)
            problem = self._check_work(work)
            if problem is not None:  # decodes, but cannot run here: rejected like malformed input
                self.counters["invalid_messages"] += 1
                self.log.error("rejected prefill work %s: %s", work.work_id, problem)
                await msg.term()
                return
            if self.store is not None and self._store_has_more(work):  # load the prefix, then admit
                self._pending_transfers += 1
                self._loading.add(work.work_id)
                self.spawn(self._load_then_admit(work, msg), f"store-load-{work.work_id}")
                return
            self._admitted(self.core.admit_prefill(work))
            self._msgs[work.work_id] = msg
            return
        item = await self.decode_work(DecodeWork, msg)
        if item is None:
            return
        if not self._pulling or "decode" not in self._queues():  # the role changed (or a drain began) while the pull was open
            self.counters["returned_not_ready"] += 1
            await msg.nak()
            return
        if self._updating or item.prefill.policy_version > self.policy_version:  # prefilled on a version not loaded here yet
            self.counters["returned_not_ready"] += 1
            await msg.nak(delay=0.1)
            return
        self._pending_transfers += 1
        self.spawn(self._pull_kv(item, msg), f"kv-{item.prefill.work_id}")

    def _store_has_more(self, work: PrefillWork) -> bool:
        """Does the store tier hold more of the trajectory's context than this engine's cache?"""
        stored = min(self.store.get(work.trajectory_id, work.policy_version), work.context_tokens)
        return stored > self.core.cached_prefix(work.trajectory_id, work.policy_version)

    async def _load_then_admit(self, work: PrefillWork, msg: Msg) -> None:
        try:
            await self._load_from_store(work)
            self._admitted(self.core.admit_prefill(work))
            self._msgs[work.work_id] = msg
        finally:
            self._loading.discard(work.work_id)
            self._pending_transfers -= 1
            self._wake.set()
            self._progress.set()

    def _stamp(self, work: PrefillWork) -> PrefillWork:
        """Async mode: a turn runs on the version this engine holds, which may be newer than the
        one it asked for; its prefix cache, held and written-back KV are then keyed by that
        version. (Sync mode: engines confirm a step's version before its work exists.)"""
        if work.policy_version < self.policy_version:
            self.counters["turns_restamped"] += 1
            return msgspec.structs.replace(work, policy_version=self.policy_version)
        return work

    def _takes_prefill(self, queue: str) -> bool:
        return self._prefills_routed_turns() if queue == "affinity" else "prefill" in self._queues()

    def _check_work(self, work: PrefillWork) -> str | None:
        """Why this engine cannot run `work` (a backend hook; None: it can)."""
        return None

    def _admitted(self, seq: Seq) -> None:
        """A backend hook: `seq` was just admitted for prefill."""

    async def _keep_alive(self) -> None:
        """Tell JetStream that long-running work is still being worked on."""
        period_wall_s = self.config.run.ack_wait_wall_s / 3
        while True:
            await self.clock.sleep_wall(period_wall_s)
            for msg in list(self._msgs.values()):
                with self.counting_bus_errors("keep_alive_failures"):
                    await msg.in_progress()

    # --- the scheduler loop in model time ------------------------------------------------
    async def _step_loop(self, burst: bool) -> None:
        scale = self.clock.time_scale  # model seconds per wall second
        quantum_s = self.max_decode_step_s or self.config.engines.decode_quantum_wall_s * scale
        cursor_s = self.clock.now_s()
        repeat_prefill = self.backend.repeats_prefill
        while not self.stopping.is_set():
            self._expire_held()
            if self._interrupt_for is not None:  # a weight update cuts in between two iterations
                await self._interrupting_update()
                cursor_s = max(cursor_s, self.clock.now_s())
            if await self._before_step():  # waited on purpose: not lag
                cursor_s = max(cursor_s, self.clock.now_s())
            self._wake.clear()  # from here on, new work interrupts the step being planned
            self.core.hold_new_handoffs = await self._decode_side_full()
            batch = self.core.plan(max_advance_s=quantum_s, repeat_prefill=repeat_prefill)
            if batch is None:
                if (
                    burst
                    and all(self._queue_empty[q] for q in self._queues())
                    and self._drained()
                    and not self.core.held
                    and not self._writebacks
                ):
                    return
                await self._wake.wait(self._idle_wait_wall_s(burst))
                cursor_s = self.clock.now_s()
                continue
            now_s = self.clock.now_s()
            if now_s - cursor_s > MAX_LAG_WALL_S * scale:
                self.counters["lag_resets"] += 1
                self.counters["lag_ms"] += round((now_s - cursor_s) * 1e3)
                cursor_s = now_s
            for kind, seq in batch.started:
                self._turn_event(EventKind(kind), seq, cursor_s)
            cursor_s = await self.backend.run(batch, cursor_s)
            self.prefilled_tokens_total += batch.prefill_tokens
            self.decoded_tokens_total += batch.decode_tokens
            for kind, seq in self.core.complete(batch):
                self._finish(kind, seq, cursor_s)
            self._count_core()
            self._room.set()
            self._progress.set()

    def _count_core(self) -> None:
        """The core's KV counters for the actor's reports: KV recomputed, parked in or loaded
        back from host memory, first prompts served from a sibling's KV, passes the
        PrefillDelayer held new prefills (each counter once it is non-zero)."""
        core = self.core
        for name in (
            "preemptions",
            "preempted_kv_tokens",
            "retractions",
            "retracted_kv_tokens",
            "host_loaded_kv_tokens",
            "prompt_cached_tokens",
            "delayed_passes",
        ):
            value = getattr(core, name)
            if value:
                self.counters[name] = value

    def _idle_wait_wall_s(self, burst: bool) -> float:
        """How long an idle scheduler sleeps unless new work wakes it: until the next held KV
        expires (a burst run also watches for the queues to run dry)."""
        wait_s = self.clock.loop_s(IDLE_WAKE_WALL_S if burst else IDLE_SAFETY_WALL_S)
        if self.core.hold_new_handoffs:  # turns wait for the decode side: look again soon
            wait_s = min(wait_s, self.clock.to_wall_s(GATE_POLL_S))
        if self.core.held:
            expires_s = min(held.expires_at_s for held in self.core.held.values()) + EXPIRY_SLACK_S
            wait_s = min(wait_s, self.clock.to_wall_s(max(0.0, expires_s - self.clock.now_s())))
        return wait_s

    def request_stop(self, reason: str = "") -> None:
        super().request_stop(reason)
        self._wake.set()  # end a long decode step now
        self._roles_changed.set()  # idle fetch loops see the stop

    async def _before_step(self) -> bool:
        """A backend hook, awaited before each step is planned; True when it waited (the
        torch engine lets KV transfers in flight land here, so their turns join the step)."""
        return False

    def _work_event(self, kind: EventKind, work: PrefillWork, **fields) -> None:
        """A lifecycle event about one submission of a turn, seen by this engine."""
        self.event(
            kind,
            trajectory_id=work.trajectory_id,
            turn=work.turn,
            attempt=work.attempt,
            task_family=work.task_family,
            policy_version=work.policy_version,
            step=work.policy_version,
            engine_id=self.actor_id,
            **fields,
        )

    def _turn_event(self, kind: EventKind, seq: Seq, at_s: float, role: str | None = None, **extra) -> None:
        """`role`: the engine's role when the event happened (default: now)."""
        w = seq.work
        self._work_event(
            kind,
            w,
            at_s=at_s,
            role=role or self.core.role.value,
            new_tokens=w.new_tokens,
            context_tokens=w.context_tokens,
            cached_prefix_tokens=seq.cached_prefix_tokens,
            **extra,
        )

    def _finish(self, kind: str, seq: Seq, at_s: float) -> None:
        if kind == "prefill_done":
            self._turn_event(EventKind.PREFILL_DONE, seq, at_s)
            if seq.handoff:
                self._effects += 1
                self.spawn(self._hand_off(seq, at_s), f"handoff-{seq.key}")
            return
        self._turn_event(EventKind.DECODE_DONE, seq, at_s, generated_tokens=seq.generated)
        self._effects += 1
        self.spawn(self._return_result(seq, at_s), f"result-{seq.key}")

    # --- heartbeat -----------------------------------------------------------------------
    def heartbeat(self) -> EngineStatus:
        now_s = self.clock.now_s()
        last_s, last_busy_s = self._last_heartbeat
        busy = (self.core.busy_s - last_busy_s) / (now_s - last_s) if now_s > last_s else 0.0
        self._last_heartbeat = (now_s, self.core.busy_s)
        return EngineStatus(
            engine_id=self.actor_id,
            at_s=now_s,
            role=self.core.role,
            epoch=self.epoch,
            policy_version=self.policy_version,
            backend=self.config.engines.backend,
            waiting_prefill=len(self.core.waiting),
            running_decode=len(self.core.decoding),
            kv_used_tokens=self.core.kv_used_tokens,
            kv_capacity_tokens=self.core.kv_capacity_tokens,
            held_kv_handles=len(self.core.held),
            busy_fraction=min(1.0, busy),
            waiting_prefill_tokens=self.core.waiting_prefill_tokens,
            decode_context_tokens=sum(s.kv_tokens for s in self.core.decoding),
            switching=self.switching,
            role_since_s=self.role_since_s,
            prefilled_tokens_total=self.prefilled_tokens_total,
            decoded_tokens_total=self.decoded_tokens_total,
            cached_prefix_tokens=self.core.cached_tokens,
            incarnation=self.incarnation,
            timing=self.core.timing.report(),
        )
