"""How an engine answers commands on `prorsa.ctl.engine.<id>` (a mixin of EngineActor).

Commands are the tagged union of `bus_schemas.control`, dispatched explicitly. `SetRole` is
idempotent for the same epoch and refuses a lower one; a switch stops pulling, lets
in-flight work finish (up to the drain deadline), waits the reconfiguration the config's
switch regime and layouts give, then pulls for the new role and acks with the drain time.
"""

from __future__ import annotations

import asyncio
import contextlib

from nats.aio.msg import Msg

from actors.engine.costmodel import switch_reconfig_s
from bus_schemas.codec import encode
from bus_schemas.control import Command, CommandAck, Drain, LoadPolicy, SetRole, Shutdown
from bus_schemas.lifecycle import EventKind

DRAIN_CHECK_WALL_S = 0.1  # how often a draining switch looks again, at the latest


class EngineCommands:
    """Needs the EngineActor attributes: core, epoch, policy_version, _pulling, _room,
    _progress, _drained(), spawn(), event(), request_stop(), decode_or_count()."""

    async def _on_command(self, msg: Msg) -> None:
        command = self.decode_or_count(Command, msg)
        if command is None:
            await self._reply(msg, "invalid", ok=False, error="malformed command")
            return
        match command:
            case LoadPolicy(version=version):
                if version < self.policy_version:
                    await self._reply(msg, "load_policy", ok=False, error=f"stale policy {version} < {self.policy_version}")
                    return
                if version > self.policy_version:
                    error = await self._load_weights(version)
                    if error is not None:
                        await self._reply(msg, "load_policy", ok=False, error=error)
                        return
                    self.policy_version = version
                    self.event(EventKind.POLICY_LOADED, policy_version=version, step=version, engine_id=self.actor_id)
                await self._reply(msg, "load_policy", ok=True)
            case SetRole():
                self.spawn(self._switch(command, msg), f"switch-{command.epoch}")
            case Drain():
                self._pulling = False
                await self._reply(msg, "drain", ok=True)
            case Shutdown(reason=reason):
                await self._reply(msg, "shutdown", ok=True)
                self.request_stop(reason or "shutdown command")

    async def _load_weights(self, version: int) -> str | None:
        """A backend hook: load policy `version`'s weights; why not, or None when loaded."""
        return None

    async def _switch(self, command: SetRole, msg: Msg) -> None:
        if command.epoch < self.epoch or (command.epoch == self.epoch and command.role is not self.core.role):
            self.counters["stale_commands"] += 1
            await self._reply(msg, "set_role", ok=False, error=f"stale epoch {command.epoch} (engine is at {self.epoch})")
            return
        if command.epoch == self.epoch:  # the same command again: already done
            await self._reply(msg, "set_role", ok=True)
            return
        started_s = self.clock.now_s()
        self.epoch = command.epoch
        self._pulling = False
        deadline_s = started_s + command.drain_deadline_s
        while not self._drained() and self.clock.now_s() < deadline_s:
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), timeout=DRAIN_CHECK_WALL_S)
        drain_s = self.clock.now_s() - started_s
        reconfig_s = switch_reconfig_s(self.config.engines, self.core.role, command.role)
        await self.clock.sleep(reconfig_s)
        self.core.preset = self.config.engines.cost_preset(command.role)
        self.core.role = command.role
        self._pulling = True
        self._room.set()
        self.event(EventKind.ROLE_SWITCHED, engine_id=self.actor_id, role=command.role.value, duration_s=drain_s + reconfig_s)
        await self._reply(msg, "set_role", ok=True, drain_s=drain_s)

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
