"""The monitor's role switches: the allocator's SetRole commands, how each was settled, and
the switches the engines logged (`role_switched`) with their cost.

A command is settled by its ack, by the `role_switched` it caused, or by a heartbeat at its
epoch; a newer epoch for the same engine supersedes an older pending one. One still pending
past `ack_grace_wall_s` plus its drain deadline (in wall seconds) is overdue.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass

from bus_schemas.control import AllocationDecision, CommandAck, SetRole
from bus_schemas.lifecycle import LifecycleEvent
from bus_schemas.status import EngineStatus
from ops.monitor_common import rounded

_SETTLED = ("acked", "refused", "superseded")
_MAX_COMMANDS = 1000  # past it only the newest half is kept


@dataclass(slots=True)
class _Command:
    engine_id: str
    role: str
    epoch: int
    wall_s: float
    drain_deadline_s: float
    state: str = "pending"  # pending | acked | refused | superseded (settled by its ack, a role_switched event or a heartbeat)


class Switches:
    def __init__(self, *, ack_grace_wall_s: float, max_switches: int) -> None:
        self.ack_grace_wall_s = ack_grace_wall_s
        self.recent: deque[dict] = deque(maxlen=max_switches)
        self.total = 0
        self.cost_s_total = 0.0
        self.commands: dict[tuple[str, int], _Command] = {}  # (engine_id, epoch) -> command
        self.by_state: Counter[str] = Counter()
        self.decision: dict | None = None  # the allocator's latest tick (AllocationDecision)

    # --- feeding ---------------------------------------------------------------------------
    def on_set_role(self, engine_id: str, c: SetRole, wall_s: float) -> None:
        key = (engine_id, c.epoch)
        if key in self.commands:  # the allocator asked again (same epoch): one switch
            return
        for old in self._pending(engine_id):
            if old.epoch < c.epoch:
                self._settle(old, "superseded")
        self.commands[key] = _Command(engine_id, c.role.value, c.epoch, wall_s, c.drain_deadline_s)
        self.by_state["sent"] += 1
        if len(self.commands) > _MAX_COMMANDS:
            for k in list(self.commands)[: -_MAX_COMMANDS // 2]:
                del self.commands[k]

    def on_ack(self, ack: CommandAck) -> None:
        if ack.command != "set_role":
            return
        cmd = self.commands.get((ack.engine_id, ack.epoch))
        if cmd is None:  # a refusal names the engine's epoch, not the command's: the oldest pending one
            cmd = next(self._pending(ack.engine_id), None)
        if cmd is not None:
            self._settle(cmd, "acked" if ack.ok else "refused")

    def on_heartbeat(self, s: EngineStatus) -> None:
        """A heartbeat at the command's epoch, not switching: the command was carried out."""
        for cmd in self._pending(s.engine_id):
            if s.epoch >= cmd.epoch and not s.switching:
                self._settle(cmd, "acked" if s.role.value == cmd.role or s.epoch > cmd.epoch else "superseded")

    def on_switched(self, ev: LifecycleEvent, from_role: str, wall_s: float) -> None:
        cmd = next(
            (
                c
                for c in reversed(self.commands.values())
                if c.engine_id == ev.engine_id and c.role == ev.role and c.state in ("pending", "acked")
            ),
            None,
        )
        if cmd is not None:
            self._settle(cmd, "acked")
        self.recent.append(
            {
                "at_s": rounded(ev.at_s),
                "engine_id": ev.engine_id,
                "from_role": from_role,
                "role": ev.role,
                "cost_s": rounded(ev.duration_s),
                "epoch": cmd.epoch if cmd is not None else None,
                "why": ev.detail,  # the allocator's reason (SetRole.reason)
                "wall_s": wall_s,
            }
        )
        self.total += 1
        self.cost_s_total += ev.duration_s

    def _pending(self, engine_id: str) -> Iterator[_Command]:
        return (c for c in self.commands.values() if c.engine_id == engine_id and c.state == "pending")

    def _settle(self, cmd: _Command, state: str) -> None:
        if cmd.state != "pending":
            return
        cmd.state = state
        self.by_state[state] += 1
        for sw in reversed(self.recent):  # the switch it caused, if logged already
            if sw["engine_id"] == cmd.engine_id and sw["epoch"] is None and sw["role"] == cmd.role:
                sw["epoch"] = cmd.epoch
                break

    def on_decision(self, d: AllocationDecision) -> None:
        """The allocator's latest tick (`prorsa.allocation`): why the fleet holds or changes."""
        if self.decision is not None and d.at_s < self.decision["at_s"]:
            return  # an older tick, late
        roles = list(d.roles.values())
        split = f"{roles.count('prefill')}:{roles.count('decode')}" + (
            f" +{roles.count('colocated')} colocated" if "colocated" in roles else ""
        )
        self.decision = {
            "at_s": rounded(d.at_s),
            "policy": d.policy,
            "split": split,
            "changes": len(d.changes),
            "reason": d.reason,
            "demand": d.demand_source,
            # measured over the prior's capacities (allocator.capacity = "measured")
            "capacity": {
                "prefill": rounded(d.capacity_prefill_scale, 3),
                "decode": rounded(d.capacity_decode_scale, 3),
                "mixed": rounded(d.capacity_mixed_scale, 3),
                "kv": rounded(d.capacity_kv_scale, 3),
            },
        }

    # --- reading out -----------------------------------------------------------------------
    def view(self, wall_s: float, scale: float | None) -> dict:
        """`scale`: model seconds per wall second (None: 1), to put drain deadlines in wall seconds."""
        return {
            "total": self.total,
            "cost_s_total": rounded(self.cost_s_total),
            "recent": [{k: v for k, v in s.items() if k != "wall_s"} for s in list(self.recent)[-20:]],
            "commands": self._commands_view(wall_s, scale or 1.0),
            "allocator": self.decision,
        }

    def _commands_view(self, wall_s: float, scale: float) -> dict:
        pending = []
        for c in self.commands.values():
            if c.state != "pending":
                continue
            age = wall_s - c.wall_s
            deadline = self.ack_grace_wall_s + c.drain_deadline_s / scale
            pending.append(
                {
                    "engine_id": c.engine_id,
                    "role": c.role,
                    "epoch": c.epoch,
                    "age_s": rounded(age, 2),
                    "deadline_s": rounded(deadline, 2),
                    "overdue": age > deadline,
                }
            )
        return {state: self.by_state[state] for state in ("sent", *_SETTLED)} | {"pending": pending}
