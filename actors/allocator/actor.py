"""The allocator actor: engine heartbeats (and forecasts) in, SetRole commands out.

    prorsa.status.engine.*  ──▶ fleet view ─┐
    prorsa.forecast (prorsa) ───────────────┼─▶ policy.decide(demand, fleet) ──▶ SetRole
    recorded log (oracle) ──────────────────┘       every allocator.tick_s      (request/reply)

Each decision round that changes anything takes the next epoch; a restarted allocator
starts above the highest epoch its engines report, so it never issues a stale command. An
engine that does not ack in time is marked unresponsive, reported, and left out of the
decisions until a later heartbeat shows it alive and not switching. Leases: an engine whose
last heartbeat arrived longer ago than `run.lease_wall_s` is likewise out (not responsive)
until it reports again; a new `incarnation` in its heartbeat (a restart, or a resume after a
lapse) is a fresh registration and clears what was held against the old one. Engines keep
their roles and keep serving whatever the allocator does (or if it is gone).
"""

from __future__ import annotations

import dataclasses

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from actors.allocator.demand import RecordedDemand, from_forecast, from_queues
from actors.allocator.measured import MeasuredSpeed
from actors.allocator.policy import Fixed, Policy, Split
from actors.allocator.state import Demand, EngineState, Fleet, RoleChange
from actors.base import Actor
from actors.base.connection import BUS_ERRORS
from actors.config import Config, initial_roles
from actors.engine.emulated.costmodel import switch_reconfig_s
from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import AllocationDecision, CommandAck, Role, SetRole
from bus_schemas.eventlog import load_events
from bus_schemas.forecast import DemandForecast
from bus_schemas.status import ActorStatus, EngineStatus
from forecasting.series import TokenCost

STARTUP_WAIT_WALL_S = 120.0  # wait this long for every engine's first heartbeat, then go on without the late ones


def make_policy(config: Config) -> Policy:
    policy = config.run.policy
    if config.runs_allocator:  # the dynamic policies resize the split; the others hold their roles
        return Split(policy, config.engines, config.allocator, weigh_cost=policy != "reactive")
    return Fixed(policy, initial_roles(config))


DECISION_DEMAND_FIELDS = (
    "prefill_tokens_per_s",
    "prefill_new_tokens_per_s",
    "decode_seqs",
    "decode_context_tokens",
    "kv_working_set_tokens",
    "live_trajectories",
    "live_context_tokens",
    "remote_share",
    "prefill_attention_tokens",
    "prefill_backlog_tokens_per_s",
    "remaining_s",
)


class AllocatorActor(Actor):
    kind = "allocator"

    def __init__(self, actor_id, config, nc, clock) -> None:
        super().__init__(actor_id, config, nc, clock)
        self.policy = make_policy(config)
        self.statuses: dict[str, EngineStatus] = {}
        self.pending: dict[str, Role] = {}  # engine -> role commanded, ack not yet in
        self.unresponsive: dict[str, float] = {}  # engine -> model time it failed to ack
        self.seen_at_s: dict[str, float] = {}  # engine -> model time its last heartbeat arrived
        self.incarnations: dict[str, str] = {}  # engine -> the registration its heartbeats carry
        self.expired: set[str] = set()  # engines whose lease ran out (reported once)
        self.lease_s = config.run.lease_wall_s * clock.time_scale  # model seconds
        self.epoch = 0
        self.forecast: DemandForecast | None = None
        self.recorded = (
            RecordedDemand(
                load_events(config.allocator.oracle_log),
                TokenCost.prefill_of(config.engines.cost_preset(Role.PREFILL)),
                initial_roles(config),
            )
            if config.run.policy == "oracle"
            else None
        )
        self.last_demand: Demand | None = None
        self.env_tokens: dict[str, tuple[int, int]] = {}  # environment -> (short, long) prefill tokens, cumulative
        self.env_turns: dict[str, int] = {}  # environment -> turns it routed, cumulative
        self._seen_tokens = (0, 0)
        self.remote_share = 1.0  # share of prefill tokens that go to prefill engines (EWMA per tick)
        self.speed = MeasuredSpeed()  # the engines' step times against the prior's (allocator.capacity = "measured")
        self._prior_kv = {role: config.engines.cost_preset(role).kv_capacity_tokens for role in Role}

    async def setup(self) -> None:
        await self.nc.subscribe(subjects.status_of_kind("engine"), cb=self._on_status)
        await self.nc.subscribe(subjects.status_of_kind("environment"), cb=self._on_env_status)
        if self.config.run.policy == "prorsa":
            await self.nc.subscribe(subjects.forecast(), cb=self._on_forecast)

    async def _on_status(self, msg: Msg) -> None:
        status = self.decode_or_count(EngineStatus, msg)
        if status is None:
            return
        self.statuses[status.engine_id] = status
        self.seen_at_s[status.engine_id] = self.clock.now_s()
        if not status.switching:  # mid-switch, its pool may be of either layout
            self.speed.observe(status.engine_id, status.incarnation, status.timing, status.kv_capacity_tokens, self._prior_kv[status.role])
        if status.engine_id in self.expired:
            self.expired.discard(status.engine_id)
            self.log.info("engine %s reports again after its lease ran out", status.engine_id)
        known = self.incarnations.get(status.engine_id)
        self.incarnations[status.engine_id] = status.incarnation
        if known is not None and status.incarnation != known:  # restarted, or resumed past its lease
            self.counters["reregistrations"] += 1
            self.unresponsive.pop(status.engine_id, None)
            self.log.info("engine %s registered again (incarnation %s, was %s)", status.engine_id, status.incarnation, known)
        failed_at_s = self.unresponsive.get(status.engine_id)
        if failed_at_s is not None and status.at_s > failed_at_s and not status.switching:  # alive and settled
            del self.unresponsive[status.engine_id]
            self.log.info("engine %s answers again (epoch %d, %s)", status.engine_id, status.epoch, status.role.value)

    async def _on_env_status(self, msg: Msg) -> None:
        status = self.decode_or_count(ActorStatus, msg)
        if status is not None:
            c = status.counters
            self.env_tokens[status.actor_id] = (c.get("prefill_short_tokens", 0), c.get("prefill_long_tokens", 0))
            self.env_turns[status.actor_id] = c.get("turns_routed", 0)

    def _update_remote_share(self) -> float:
        short = sum(s for s, _ in self.env_tokens.values())
        long = sum(g for _, g in self.env_tokens.values())
        d_short, d_long = short - self._seen_tokens[0], long - self._seen_tokens[1]
        self._seen_tokens = (short, long)
        if d_short + d_long > 0:
            self.remote_share = 0.5 * self.remote_share + 0.5 * d_long / (d_short + d_long)
        return self.remote_share

    async def _on_forecast(self, msg: Msg) -> None:
        forecast = self.decode_or_count(DemandForecast, msg)
        if forecast is not None:
            self.forecast = forecast

    async def serve(self, burst: bool) -> None:
        try:
            await self.wait_for_heartbeats("engine", self.config.engine_ids(), STARTUP_WAIT_WALL_S)
        except RuntimeError as err:  # slow starters (a vLLM engine on a busy host) join when they report
            self.counters["late_engines_at_start"] += 1
            self.log.warning("%s; allocating over the engines that did report", err)
        self.epoch = max((s.epoch for s in self.statuses.values()), default=0)
        self.log.info("allocator up: policy=%s, fleet epoch %d", self.policy.name, self.epoch)
        while not self.stopping.is_set():
            await self.decide_once()
            await self.clock.sleep(self.config.allocator.tick_s)

    def lease_expired(self, engine_id: str) -> bool:
        """Has `engine_id` been silent for longer than its lease? (Reported once per lapse.)"""
        silent_s = self.clock.now_s() - self.seen_at_s.get(engine_id, self.clock.now_s())
        if silent_s <= self.lease_s:
            return False
        if engine_id not in self.expired:
            self.expired.add(engine_id)
            self.counters["lease_expiries"] += 1
            self.log.warning(
                "engine %s: no heartbeat for %.1f s (model), past its lease; out of allocation until it reports", engine_id, silent_s
            )
        return True

    def fleet(self) -> Fleet:
        engines = []
        for engine_id in self.config.engine_ids():
            s = self.statuses.get(engine_id)
            if s is None:
                continue
            expired = self.lease_expired(engine_id)
            pending = self.pending.get(engine_id)
            engines.append(
                EngineState(
                    engine_id=engine_id,
                    role=pending or s.role,
                    epoch=s.epoch,
                    waiting_prefill=s.waiting_prefill,
                    waiting_prefill_tokens=s.waiting_prefill_tokens,
                    running_decode=s.running_decode,
                    decode_context_tokens=s.decode_context_tokens,
                    kv_held_tokens=s.kv_used_tokens + s.cached_prefix_tokens,
                    held_kv_handles=s.held_kv_handles,
                    role_since_s=s.role_since_s,
                    prefilled_tokens_total=s.prefilled_tokens_total,
                    decoded_tokens_total=s.decoded_tokens_total,
                    switching=s.switching or pending is not None,
                    responsive=engine_id not in self.unresponsive and not expired,
                )
            )
        new_tokens = sum(short + long for short, long in self.env_tokens.values())
        return Fleet(
            now_s=self.clock.now_s(), engines=tuple(engines), new_tokens_total=new_tokens, turns_total=sum(self.env_turns.values())
        )

    def demand(self, fleet: Fleet) -> Demand | None:
        horizon_s = self.config.allocator.horizon_s
        match self.config.run.policy:
            case "reactive":
                return from_queues(fleet, horizon_s)
            case "prorsa":
                return (
                    None
                    if self.forecast is None
                    else from_forecast(self.forecast, fleet, horizon_s, self.config.allocator.provision_quantile)
                )
            case "oracle":
                return self.recorded.at(fleet, horizon_s) if self.recorded is not None else None
        return None

    async def decide_once(self) -> list[RoleChange]:
        fleet = self.fleet()
        share = self._update_remote_share()
        demand = self.demand(fleet)
        if demand is not None:
            demand = dataclasses.replace(demand, remote_share=share)
        self.last_demand = demand
        self._learn_capacity()
        changes = self.policy.decide(demand, fleet)
        self.counters["decisions"] += 1
        if changes:
            self.epoch += 1
            self.counters["rounds_with_switches"] += 1
            why = getattr(self.policy, "last_reason", "") or changes[0].why
            self.log.info("epoch %d: %s (%s)", self.epoch, ", ".join(f"{c.engine_id}->{c.role.value}" for c in changes), why)
            for change in changes:
                self.pending[change.engine_id] = change.role
                self.spawn(self._command(change, self.epoch), f"set-role-{change.engine_id}-{self.epoch}")
        await self._publish_decision(fleet, demand, changes)
        return changes

    def _learn_capacity(self) -> None:
        """allocator.capacity = "measured": the window of the engines' step times slides, and
        the policy's capacities take the factors it gives (actors/allocator/measured.py)."""
        self.speed.tick()
        capacity = getattr(self.policy, "capacity", None)
        if capacity is not None and self.config.allocator.capacity == "measured":
            capacity.scales = self.speed.scales()

    async def _publish_decision(self, fleet: Fleet, demand: Demand | None, changes: list[RoleChange]) -> None:
        """This tick's AllocationDecision, for watchers and the simulation's record."""
        figures = {}
        if demand is not None:
            figures = {name: float(getattr(demand, name)) for name in DECISION_DEMAND_FIELDS}
            figures["demand_source"] = demand.source
        capacity = getattr(self.policy, "capacity", None)
        if capacity is not None:
            scales, cap = capacity.scales, capacity.at(fleet.mean_decode_context_tokens if demand is None else demand.decode_context_tokens)
            figures |= {
                "capacity_prefill_scale": scales.prefill,
                "capacity_decode_scale": scales.decode,
                "capacity_mixed_scale": scales.mixed,
                "capacity_kv_scale": scales.kv,
                "prefill_s_per_token": cap.prefill_s_per_token,
                "colocated_prefill_s_per_token": cap.colocated_prefill_s_per_token,
                "decode_kv_step_s": cap.decode_kv_step_s,
            }
        decision = AllocationDecision(
            at_s=fleet.now_s,
            policy=self.policy.name,
            epoch=self.epoch,
            roles={e.engine_id: e.role.value for e in fleet.engines},
            changes={c.engine_id: c.role.value for c in changes},
            reason=getattr(self.policy, "last_reason", ""),
            **figures,
        )
        with self.counting_bus_errors("decision_publish_failures"):
            await self.nc.publish(subjects.allocation(), encode(decision))

    async def _command(self, change: RoleChange, epoch: int) -> None:
        ac = self.config.allocator
        engines = self.config.engines
        old = self.statuses[change.engine_id].role
        model_s = ac.drain_deadline_s + switch_reconfig_s(engines, old, change.role)
        timeout_s = self.clock.loop_s(ac.ack_timeout_wall_s) + self.clock.to_wall_s(model_s)  # loop seconds
        command = SetRole(role=change.role, epoch=epoch, drain_deadline_s=ac.drain_deadline_s, reason=change.why)
        try:
            reply = await self.nc.request(subjects.ctl_engine(change.engine_id), encode(command), timeout=timeout_s)
            ack = decode(CommandAck, reply.data)
        except (TimeoutError, NoRespondersError) as err:
            self.unresponsive[change.engine_id] = self.clock.now_s()
            self.counters["unacked_commands"] += 1
            self.log.warning(
                "engine %s did not ack SetRole(%s, epoch %d): %s; left out until it answers",
                change.engine_id,
                change.role.value,
                epoch,
                err or "timeout",
            )
            return
        except (msgspec.DecodeError, msgspec.ValidationError) as err:  # a malformed ack
            self.unresponsive[change.engine_id] = self.clock.now_s()
            self.counters["invalid_messages"] += 1
            self.log.error("engine %s sent a malformed ack: %s", change.engine_id, err)
            return
        except BUS_ERRORS as err:  # any other bus failure: the command may not have arrived
            self.unresponsive[change.engine_id] = self.clock.now_s()
            self.counters["command_errors"] += 1
            self.log.error(
                "SetRole(%s, epoch %d) to engine %s failed on the bus: %r; left out until it answers",
                change.role.value,
                epoch,
                change.engine_id,
                err,
            )
            return
        finally:
            self.pending.pop(change.engine_id, None)
        if ack.ok:
            self.counters["switches"] += 1
            self.counters["drain_ms"] += round(ack.drain_s * 1e3)
        else:
            self.counters["refused_commands"] += 1
            self.epoch = max(self.epoch, ack.epoch)
            self.log.warning("engine %s refused SetRole(%s, epoch %d): %s", change.engine_id, change.role.value, epoch, ack.error)

    def heartbeat(self) -> ActorStatus:
        return ActorStatus(actor_id=self.actor_id, kind=self.kind, at_s=self.clock.now_s(), counters=dict(self.counters))
