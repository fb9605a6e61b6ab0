"""How an engine answers commands on `prorsa.ctl.engine.<id>` (a mixin of EngineActor).

Commands are the tagged union of `bus_schemas.control`, dispatched explicitly. `SetRole` is
idempotent for the same epoch and refuses a lower one. Only a switch *to prefill* has
something to move out: it stops pulling, lets running decodes finish until the drain
deadline, then migrates the rest with their KV to another decode engine (its waiting
prefills stay and hand their KV over when done). A switch to decode or colocated keeps
everything in flight. Either way the engine then waits the reconfiguration the config's
switch regime and layouts give, pulls for the new role, and acks with the drain time.
"""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from actors.engine.emulated.costmodel import switch_reconfig_s, weight_sync_s
from bus_schemas.codec import encode
from bus_schemas.control import Command, CommandAck, Drain, LoadPolicy, Role, SetRole, Shutdown
from bus_schemas.lifecycle import EventKind

DRAIN_CHECK_WALL_S = 0.1  # how often a draining switch looks again, at the latest


class EngineCommands:
    """Needs the EngineActor attributes: core, epoch, target_role, _switched (set when no switch
    is under way), policy_version, switching, role_since_s,
    _pulling, _room, _progress, migrates_decodes, migrate_decodes(), spawn(),
    event(), publish_heartbeat(), request_stop(), decode_or_count()."""

    async def _on_role_command(self, msg: Msg) -> None:
        await self._on_command(msg, policy_subject=False)

    async def _on_policy_command(self, msg: Msg) -> None:
        await self._on_command(msg, policy_subject=True)

    async def _on_command(self, msg: Msg, policy_subject: bool) -> None:
        command = self.decode_or_count(Command, msg)
        if command is None:
            await self._reply(msg, "invalid", ok=False, error="malformed command")
            return
        if isinstance(command, LoadPolicy) != policy_subject:  # each family on its own subject (access control)
            self.counters["commands_on_wrong_subject"] += 1
            want = "ctl.policy" if isinstance(command, LoadPolicy) else "ctl.engine"
            self.log.error("refused %s on %s: it belongs on prorsa.%s.<engine>", type(command).__name__, msg.subject, want)
            await self._reply(msg, "invalid", ok=False, error=f"{type(command).__name__} belongs on prorsa.{want}.<engine>")
            return
        match command:
            case LoadPolicy(version=version):
                if version < self.policy_version:
                    await self._reply(msg, "load_policy", ok=False, error=f"stale policy {version} < {self.policy_version}")
                    return
                if version > self.policy_version and self.config.run.mode == "async":
                    self.spawn(self._reply_when_updated(version, msg), f"update-{version}")  # replies once loaded
                    return
                if version > self.policy_version:
                    error = await self._load_weights(version)
                    if error is not None:
                        await self._reply(msg, "load_policy", ok=False, error=error)
                        return
                    self.policy_version = version
                    self.core.drop_cache_below(version)  # never reused (the KV of older weights): not held either
                    self.event(EventKind.POLICY_LOADED, policy_version=version, step=version, engine_id=self.actor_id)
                await self._reply(msg, "load_policy", ok=True)
            case SetRole():
                self.spawn(self._switch(command, msg), f"switch-{command.epoch}")
            case Drain():
                self._pulling = False
                self._roles_changed.set()
                await self._reply(msg, "drain", ok=True)
            case Shutdown(reason=reason):
                await self._reply(msg, "shutdown", ok=True)
                self.request_stop(reason or "shutdown command")

    async def _load_weights(self, version: int) -> str | None:
        """A backend hook: load policy `version`'s weights; why not, or None when loaded."""
        return None

    # --- weight updates mid-rollout (run.mode = "async", docs/async.md) -------------------------
    def _init_updates(self) -> None:
        self._updating = False  # no pulls while set; the step loop runs what is in flight
        self._interrupt_for: tuple[int, asyncio.Future] | None = None  # the step loop applies it between iterations
        self._interrupting_to = -1  # an interrupting update's version, from its request until it is loaded
        self._updates: dict[int, asyncio.Task] = {}  # version -> its update (a repeated LoadPolicy waits on it)
        self._update_lock = asyncio.Lock()

    def _weight_sync_s(self) -> float:
        """Modelled time to receive a version's weights (a backend hook: real backends return 0
        and take what `_load_weights` really takes)."""
        return weight_sync_s(self.core.preset, self.link)

    async def _reply_when_updated(self, version: int, msg: Msg) -> None:
        task = self._updates.get(version)
        if task is None:
            task = self._updates[version] = self.spawn(self._update_policy(version), f"load-policy-{version}")
        error = await asyncio.shield(task)
        await self._reply(msg, "load_policy", ok=error is None, error=error or "")

    async def _update_policy(self, version: int) -> str | None:
        """Take `version` while rollout goes on: stop pulling; then either let every in-flight
        turn finish on the old weights ("finish") or cut them at the next iteration boundary
        ("interrupt"); receive the weights; pull again. Returns why not, or None."""
        async with self._update_lock:
            if version <= self.policy_version:
                return None
            mode = self.config.engines.inflight_on_update
            started_s = self.clock.now_s()
            self._updating = True
            self._roles_changed.set()
            self.event(EventKind.POLICY_UPDATE_STARTED, policy_version=version, step=version, engine_id=self.actor_id, detail=mode)
            try:
                if mode == "interrupt":
                    done = asyncio.get_running_loop().create_future()
                    self._interrupt_for = (version, done)
                    self._interrupting_to = version  # KV of older versions landing from now on is refused
                    self._wake.set()  # a multi-iteration step ends at its next iteration boundary
                    try:
                        error = await done
                    finally:
                        self._interrupting_to = -1
                else:
                    while not self._drained():
                        await self._next_progress()
                    drain_s = self.clock.now_s() - started_s
                    self.counters["update_drain_ms"] += round(drain_s * 1e3)
                    error = await self._take_weights(version)
            finally:
                self._updating = False
                self._room.set()
                self._roles_changed.set()
                self._wake.set()
            if error is None:
                self.counters["policy_updates"] += 1
                self.event(
                    EventKind.POLICY_LOADED,
                    policy_version=version,
                    step=version,
                    engine_id=self.actor_id,
                    duration_s=self.clock.now_s() - started_s,
                    detail=mode,
                )
                await self.publish_heartbeat()
            else:
                self.log.error("could not load policy %d: %s", version, error)
            return error

    async def _take_weights(self, version: int) -> str | None:
        """Receive `version`'s weights (modelled time, then the backend's load) and switch to it."""
        await self.clock.sleep(self._weight_sync_s())
        error = await self._load_weights(version)
        if error is None:
            self.policy_version = version
            self.core.drop_cache_below(version)
        return error

    async def _interrupting_update(self) -> None:
        """Called by the step loop between two iterations: cut every in-flight turn (its tokens
        so far stay; its KV is recomputed under the new weights), then take the weights."""
        version, done = self._interrupt_for
        self._interrupt_for = None
        old, now_s = self.policy_version, self.clock.now_s()
        cut = self.core.interrupt(version)
        for seq in cut:
            self._turn_event(EventKind.TURN_INTERRUPTED, seq, now_s, detail=f"policy {old} -> {version}", generated_tokens=seq.generated)
            self.counters["turns_interrupted"] += 1
        self.on_interrupted(cut, version)
        error = await self._take_weights(version)
        if not done.done():
            done.set_result(error)

    def on_interrupted(self, cut: list, version: int) -> None:
        """A real backend drops the KV of the sequences `core.interrupt` cut (the emulated one
        has none to drop)."""

    async def _switch(self, command: SetRole, msg: Msg) -> None:
        if command.epoch < self.epoch or (command.epoch == self.epoch and command.role is not self.target_role):
            self.counters["stale_commands"] += 1
            await self._reply(msg, "set_role", ok=False, error=f"stale epoch {command.epoch} (engine is at {self.epoch})")
            return
        if command.epoch == self.epoch:  # the same command again: ack once it is carried out
            await self._switched.wait()
            await self._reply(msg, "set_role", ok=True)
            return
        if command.role is self.target_role and not self.switching:  # nothing to change but the epoch
            self.epoch = command.epoch
            self._resume_pulling()  # a SetRole also ends a Drain
            await self._reply(msg, "set_role", ok=True)
            return
        await self._switched.wait()  # a newer command waits for the switch under way
        self._switched.clear()
        try:
            await self._carry_out(command, msg)
        finally:
            self._switched.set()

    async def _carry_out(self, command: SetRole, msg: Msg) -> None:
        started_s = self.clock.now_s()
        self.epoch = command.epoch
        self.target_role = command.role
        self.switching = True
        self._roles_changed.set()
        reconfig_s = switch_reconfig_s(self.config.engines, self.core.role, command.role)
        if command.role is Role.PREFILL or reconfig_s > 0:  # decodes cannot stay (nothing can, for a reload)
            self._pulling = False
            if command.role is Role.PREFILL:
                self.core.hand_off_waiting()
            deadline_s = started_s + command.drain_deadline_s
            while True:
                await self._drain_decodes(deadline_s)
                if self.core.decoding:
                    moved = await self.migrate_decodes()
                    self.log.info("switch %d: %d decodes moved to another engine at the drain deadline", command.epoch, moved)
                if reconfig_s == 0 or self._drained():
                    break
                await self._next_progress()
        # to decode or colocated nothing has to leave: waiting prefills finish (handing off their
        # KV if they were a prefill engine's), decodes go on
        drain_s = self.clock.now_s() - started_s
        await self.clock.sleep(reconfig_s)
        self.core.preset, self.core.prior = self.config.engines.engine_presets(command.role, self.actor_id)
        self.core.role = command.role
        self.role_since_s = self.clock.now_s()
        self.switching = False
        self._resume_pulling()
        self.event(
            EventKind.ROLE_SWITCHED,
            engine_id=self.actor_id,
            role=command.role.value,
            duration_s=drain_s + reconfig_s,
            detail=command.reason,
        )
        await self._reply(msg, "set_role", ok=True, drain_s=drain_s)
        await self.publish_heartbeat()  # the fleet view sees the new role now, not a period later

    def _resume_pulling(self) -> None:
        self._pulling = True
        self._room.set()
        self._roles_changed.set()
        self._wake.set()  # the scheduler plans under the (new) role now

    async def _drain_decodes(self, deadline_s: float) -> None:
        """Wait for the running decodes to finish, until the deadline (no deadline for a
        backend that cannot move a decode mid-turn)."""
        while self.core.decoding and (self.clock.now_s() < deadline_s or not self.migrates_decodes):
            await self._next_progress()

    async def _next_progress(self) -> None:
        self._progress.clear()
        await self._progress.wait(DRAIN_CHECK_WALL_S)

    async def _reply(self, msg: Msg, command: str, ok: bool, error: str = "", drain_s: float = 0.0) -> None:
        if not msg.reply:
            return
        ack = CommandAck(
            engine_id=self.actor_id,
            command=command,
            ok=ok,
            error=error,
            role=self.core.role,
            epoch=self.epoch,
            policy_version=self.policy_version,
            drain_s=drain_s,
        )
        await msg.respond(encode(ack))
