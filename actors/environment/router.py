"""Per-turn placement of prefill work (pure: no bus, no clock).

Every policy but plain `colocated` routes a turn to an engine's own queue:

* a short append (dynamic policies only: at most `local_prefill_max_tokens` new tokens, or
  any append smaller than half its context, which a prefill engine would have to recompute)
  is prefilled where the KV of the trajectory's whole context lives — the engine that
  decoded its last turn, a decode engine included — so only the append is computed and
  nothing moves; the other turns (a first prompt, a long append on a short context) go to a
  prefill engine, or a colocated one;
* either way the engine holding the prefix is chosen unless its queue is longer than the
  least loaded candidate's by more than the prefix a miss would recompute; a new trajectory
  goes to the least loaded.

An engine's load is the prefill tokens it reported waiting in its last heartbeat, plus what
this router sent it since, plus `SEQ_LOAD_TOKENS` per sequence it decodes: a trajectory
moves off an engine that decodes far more than another once that imbalance outweighs the
prefix it has to recompute elsewhere (after a PD phase, say, which gathers every
trajectory's KV on the decode engines). Before the first heartbeats every engine counts as an idle colocated
one (an engine that does not prefill forwards what it gets to the shared queue).
"""

from __future__ import annotations

from dataclasses import dataclass

from bus_schemas.control import Role
from bus_schemas.status import EngineStatus


SEQ_LOAD_TOKENS = 1024  # a decoding sequence weighs like this many queued prefill tokens


@dataclass(slots=True)
class _Engine:
    role: Role
    switching: bool
    waiting_tokens: int = 0  # admitted, not yet prefilled (its last heartbeat)
    running_decode: int = 0  # sequences decoding (its last heartbeat)
    routed_tokens: int = 0  # sent by this router since that heartbeat

    @property
    def load_tokens(self) -> int:
        return self.waiting_tokens + self.routed_tokens + SEQ_LOAD_TOKENS * self.running_decode


class Router:
    def __init__(self, engine_ids: list[str], local_prefill_max_tokens: int = 0) -> None:
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.engines: dict[str, _Engine] = {e: _Engine(Role.COLOCATED, False, 0) for e in engine_ids}
        self.short_tokens = 0  # new tokens of turns short enough to prefill where their KV is
        self.long_tokens = 0  # ... and of the others: the prefill engines' share of the demand
        self.routed_local = 0
        self.routed_home = 0
        self.routed_balance = 0

    def observe(self, status: EngineStatus) -> None:
        self.engines[status.engine_id] = _Engine(status.role, status.switching, status.waiting_prefill_tokens, status.running_decode)

    def route(self, kv_engine_id: str, prefix_engine_id: str, context_tokens: int, new_tokens: int) -> str | None:
        """The engine whose own queue gets this turn; None: the shared prefill queue.

        `kv_engine_id` decoded the trajectory's last turn (it holds all of its context),
        `prefix_engine_id` prefilled it (it holds the context up to that turn's output)."""
        ready = {e: s for e, s in self.engines.items() if not s.switching}
        local = self.local_prefill_max_tokens > 0
        short = local and (new_tokens <= self.local_prefill_max_tokens or 2 * new_tokens <= context_tokens)
        if short:
            self.short_tokens += new_tokens
            candidates = ready  # every engine prefills a short append where its KV is
        else:
            self.long_tokens += new_tokens
            candidates = {e: s for e, s in ready.items() if s.role is not Role.DECODE}
            if not candidates and local:
                candidates = ready  # no prefill engine at all: decode engines prefill locally
        if not candidates:
            return None
        least = min(candidates, key=lambda e: (candidates[e].load_tokens, e))
        homes = (kv_engine_id, prefix_engine_id) if short else (prefix_engine_id, kv_engine_id)
        home_id = next((e for e in homes if e in candidates), "")
        if home_id and candidates[home_id].load_tokens <= candidates[least].load_tokens + context_tokens:
            chosen = home_id
            if short and home_id == kv_engine_id:
                self.routed_local += 1
            else:
                self.routed_home += 1
            candidates[chosen].routed_tokens += new_tokens
        else:
            chosen, self.routed_balance = least, self.routed_balance + 1
            candidates[chosen].routed_tokens += context_tokens + new_tokens
        return chosen

    def counters(self) -> dict[str, int]:
        return {
            "prefill_short_tokens": self.short_tokens,
            "prefill_long_tokens": self.long_tokens,
            "routed_local": self.routed_local,
            "routed_home": self.routed_home,
            "routed_balance": self.routed_balance,
        }
