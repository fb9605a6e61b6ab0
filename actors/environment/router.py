"""Per-turn placement of prefill work (pure: no bus, no clock).

Every policy but plain `colocated` routes a turn to an engine's own queue:

* a short append (every policy with decode engines: at most `local_prefill_max_tokens` new tokens, or
  any append smaller than half its context, which a prefill engine would have to recompute)
  is prefilled where the KV of the trajectory's whole context lives — the engine that
  decoded its last turn, a decode engine included — so only the append is computed and
  nothing moves; the other turns (a first prompt, a long append on a short context) go to a
  prefill engine, or a colocated one. Not on a decode engine under SGLang's prefill-first
  lockstep (`decode_lockstep`) while the decode side is full: there one rank's chunk holds
  every rank's decodes (R times a prefill engine's cost), and the append is routed as a long
  one;
* either way the engines holding the trajectory's KV are tried in order (a short append: the
  engine that decoded its last turn, then the one that prefilled it; a long turn: the
  prefix holder first) before the least loaded candidate. A holder keeps the turn unless its
  queue is longer than the least loaded's by more than the prefix a miss would recompute; a
  prefill engine keeps it as long as the least loaded has at least that miss queued itself
  (moving would recompute the prefix and keep no engine from running dry). So a short append
  leaving a busy decode engine goes to its prefix holder, not to a prefill engine that would
  recompute it all. A new trajectory goes to the least loaded.

With KV write-back (`engines.kv_writeback`, `writeback`), the prefix holder (the engine that
prefilled the last turn, or the prefill-side holder a short append kept on its decode engine
wrote back to: the environment passes it as `PrefillWork.writeback_engine_id`) holds the
trajectory's whole context once the decode engine's output is written back ("to-prefill"),
and with "store" any prefill engine loads it from the store tier. Then only
appends of at most `local_prefill_max_tokens` count as short (the half-the-context rule
existed because a prefill engine recomputed the last output), and the balance threshold is
what a miss elsewhere costs: the whole context recomputed ("none", "to-prefill"), or loaded
from the store (`miss_share`: its load time per token over a prefill token's, from the cost
model, `store_miss_share`).

An engine's load is the prefill tokens it reported waiting in its last heartbeat, plus what
this router sent it since, plus `SEQ_LOAD_TOKENS` per sequence it decodes: a trajectory
moves off an engine that decodes far more than another once that imbalance outweighs the
prefix it has to recompute elsewhere (after a PD phase, say, which gathers every
trajectory's KV on the decode engines). Before the first heartbeats every engine counts as an idle colocated
one (an engine that does not prefill forwards what it gets to the shared queue). An engine
silent for longer than its lease (`run.lease_wall_s`) gets no turns until it reports again.

A first turn whose prompt its GRPO siblings share (`prompt_key`, with `workload.share_prompts`)
goes where a sibling's first turn went, the engine likeliest to hold the prompt's KV in its
prefix cache, as SGLang's cache-aware router does by prefix matching: that engine is the
turn's home, and a miss elsewhere recomputes the prompt, so it keeps the turn unless its load
exceeds the least loaded's by more than the prompt's tokens (the rules above). A turn kept
there adds nothing to its load (the prompt is expected from the cache; the next heartbeat
says what it really queued); the prompt's home is the engine its last sibling went to,
remembered for the last `PROMPT_HOMES` prompts. Each environment has its own router, so
siblings pulled by different environments do not share a home.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from bus_schemas.control import Role
from bus_schemas.status import EngineStatus

SEQ_LOAD_TOKENS = 1024  # a decoding sequence weighs like this many queued prefill tokens
# a decode engine this full of KV decodes all the batch it can hold (the 90% occupancy the
# allocator sizes pools to) [A]
KV_FULL_SHARE = 0.9
PROMPT_HOMES = 4096  # prompts whose engine a router remembers (least recently routed forgotten first)


@dataclass(slots=True)
class _Engine:
    role: Role
    switching: bool
    seen_at_s: float | None = None  # when its last heartbeat arrived (None: none yet)
    waiting_tokens: int = 0  # admitted, not yet prefilled (its last heartbeat)
    running_decode: int = 0  # sequences decoding (its last heartbeat)
    routed_tokens: int = 0  # sent by this router since that heartbeat
    kv_full: bool = False  # its KV at least KV_FULL_SHARE used (its last heartbeat)
    held_handles: int = 0  # prefilled turns it holds for a decode engine to take (its last heartbeat)

    @property
    def load_tokens(self) -> int:
        return self.waiting_tokens + self.routed_tokens + SEQ_LOAD_TOKENS * self.running_decode


def store_miss_share(engines) -> float:
    """What loading a context token from the store tier costs, as a share of prefilling it
    (`engines`: the config's EngineSection), from the cost model: full chunks on a typical
    prefix against the store link's transfer of that chunk's KV."""
    from actors.engine.emulated.costmodel import LINKS, prefill_s, transfer_s

    preset = engines.cost_preset(Role.PREFILL)
    chunk = engines.max_batch_tokens
    compute_s = prefill_s(preset, chunk, TYPICAL_PREFIX_TOKENS)
    load_s = transfer_s(LINKS[engines.kv_store_link], chunk * preset.kv_bytes_per_token)
    return min(1.0, load_s / compute_s) if compute_s > 0 else 1.0


TYPICAL_PREFIX_TOKENS = 8192  # the prefix a typical agentic turn's prefill runs on


class Router:
    def __init__(
        self,
        engine_ids: list[str],
        local_prefill_max_tokens: int = 0,
        writeback: str = "none",
        miss_share: float = 1.0,
        lease_s: float = float("inf"),
        decode_lockstep: bool = False,
    ) -> None:
        """`writeback`: the fleet's `engines.kv_writeback`; `miss_share`: with "store", what a
        context token costs an engine that loads it from the store, against prefilling it;
        `lease_s`: model seconds after its last heartbeat that an engine stops being a candidate;
        `decode_lockstep`: decode engines run SGLang's prefill-first lockstep over several
        DP-attention ranks (`EngineSection.decode_lockstep`): a full one gets no appends."""
        self.lease_s = lease_s
        self.routed_around_expired = 0  # candidates skipped because their lease ran out
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.decode_lockstep = decode_lockstep
        self.writeback = writeback
        self.miss_share = miss_share if writeback == "store" else 1.0
        self.engines: dict[str, _Engine] = {e: _Engine(Role.COLOCATED, False) for e in engine_ids}
        self.short_tokens = 0  # new tokens of turns short enough to prefill where their KV is
        self.long_tokens = 0  # ... and of the others: the prefill engines' share of the demand
        self.routed_local = 0
        self.routed_home = 0
        self.routed_balance = 0
        self.routed_prompt_home = 0  # first turns sent where a sibling's prompt went
        self.prompt_homes: OrderedDict[str, str] = OrderedDict()  # prompt key -> engine its last first turn went to
        self.turns = 0  # turns routed (every call of `route`)

    def observe(self, status: EngineStatus, seen_at_s: float | None = None) -> None:
        """`seen_at_s`: when the heartbeat arrived (model seconds), for the lease."""
        self.engines[status.engine_id] = _Engine(
            status.role,
            status.switching,
            seen_at_s,
            waiting_tokens=status.waiting_prefill_tokens,
            running_decode=status.running_decode,
            kv_full=status.kv_used_tokens >= KV_FULL_SHARE * status.kv_capacity_tokens > 0,
            held_handles=status.held_kv_handles,
        )

    def route(
        self,
        kv_engine_id: str,
        prefix_engine_id: str,
        context_tokens: int,
        new_tokens: int,
        now_s: float | None = None,
        prompt_key: str = "",
    ) -> str | None:
        """The engine whose own queue gets this turn; None: the shared prefill queue.

        `kv_engine_id` decoded the trajectory's last turn (it holds all of its context),
        `prefix_engine_id` prefilled it (it holds the context up to that turn's output; with
        write-back, all of it). With `now_s`, an engine whose last heartbeat is older than the
        lease is not a candidate until it reports again. `prompt_key`: a first turn's prompt
        identity, shared by its siblings (empty: none shared)."""
        self.turns += 1
        prompt_key = prompt_key if context_tokens == 0 else ""
        prompt_home = self.prompt_homes.get(prompt_key, "") if prompt_key else ""
        ready = {e: s for e, s in self.engines.items() if not s.switching and not self._expired(s, now_s)}
        local = self.local_prefill_max_tokens > 0 and not self._stalls_lockstep(ready.get(kv_engine_id))
        # without write-back, a prefill engine would recompute the last output: an append small
        # against its context stays where the KV is; with it, only a really short one does
        recompute_rule = self.writeback == "none" and 2 * new_tokens <= context_tokens
        short = local and (new_tokens <= self.local_prefill_max_tokens or recompute_rule)
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
        miss_tokens = context_tokens * self.miss_share  # what sending it elsewhere costs (recompute or store load)
        home_tokens, away_tokens = new_tokens, round(miss_tokens) + new_tokens  # what each adds to the engine's load
        if prompt_home:  # a sibling's prompt: its KV is likely cached where that sibling went
            homes, miss_tokens, home_tokens, away_tokens = (prompt_home,), new_tokens, 0, new_tokens
        home_id = next((e for e in homes if e in candidates and self._stays_home(candidates[e], candidates[least], miss_tokens)), "")
        if home_id:
            chosen = home_id
            if prompt_home:
                self.routed_prompt_home += 1
            elif short and home_id == kv_engine_id:
                self.routed_local += 1
            else:
                self.routed_home += 1
            candidates[chosen].routed_tokens += home_tokens
        else:
            chosen, self.routed_balance = least, self.routed_balance + 1
            candidates[chosen].routed_tokens += away_tokens
        if prompt_key:
            self._remember_prompt(prompt_key, chosen)
        return chosen

    def _remember_prompt(self, prompt_key: str, engine_id: str) -> None:
        self.prompt_homes[prompt_key] = engine_id
        self.prompt_homes.move_to_end(prompt_key)
        while len(self.prompt_homes) > PROMPT_HOMES:
            self.prompt_homes.popitem(last=False)

    def _stalls_lockstep(self, engine: _Engine | None) -> bool:
        """Whether an append on `engine` would hold a full batch of decodes: a decode engine
        under prefill-first lockstep while the decode side is full — its KV is, or prefill
        engines hold prefilled turns that no decode engine has room for. There one rank's
        chunk stalls every rank's decodes, R times the engine-seconds a prefill engine spends
        on it, ahead of turns already waiting."""
        if not (self.decode_lockstep and engine is not None and engine.role is Role.DECODE):
            return False
        return engine.kv_full or any(e.held_handles > 0 for e in self.engines.values() if e.role is Role.PREFILL)

    @staticmethod
    def _stays_home(home: _Engine, least: _Engine, miss_tokens: float) -> bool:
        """Whether a turn stays on an engine holding its KV rather than go to the least loaded.
        A prefill engine keeps it while the least loaded has at least the miss queued: moving
        would only recompute the prefix and no engine would run dry without it (work
        conserving). Otherwise it stays while its load exceeds the least loaded's by no more
        than the prefix a miss would recompute."""
        if home.role is Role.PREFILL and least.load_tokens >= miss_tokens:
            return True
        return home.load_tokens <= least.load_tokens + miss_tokens

    def _expired(self, engine: _Engine, now_s: float | None) -> bool:
        if now_s is None or engine.seen_at_s is None or now_s - engine.seen_at_s <= self.lease_s:
            return False
        self.routed_around_expired += 1
        return True

    def counters(self) -> dict[str, int]:
        return {
            "prefill_short_tokens": self.short_tokens,
            "prefill_long_tokens": self.long_tokens,
            "turns_routed": self.turns,
            "routed_local": self.routed_local,
            "routed_home": self.routed_home,
            "routed_balance": self.routed_balance,
            "routed_prompt_home": self.routed_prompt_home,
            "routed_around_expired": self.routed_around_expired,
        }
