"""What the allocator's policies read and return (pure data): the fleet as its heartbeats
show it, the demand over the decision horizon, and a role change."""

from __future__ import annotations

from dataclasses import dataclass, replace

from bus_schemas.control import Role

DEFAULT_CONTEXT_TOKENS = 4096.0  # typical context before any engine has reported one


@dataclass(frozen=True, slots=True)
class EngineState:
    """What the allocator knows of one engine (its last heartbeat, and its own bookkeeping)."""

    engine_id: str
    role: Role
    epoch: int = 0
    waiting_prefill: int = 0
    waiting_prefill_tokens: int = 0
    running_decode: int = 0
    decode_context_tokens: int = 0
    kv_held_tokens: int = 0  # KV resident or cached (trajectories between turns included)
    held_kv_handles: int = 0
    role_since_s: float = 0.0
    switching: bool = False
    responsive: bool = True  # False: it missed a SetRole ack; left out until it answers again
    prefilled_tokens_total: int = 0  # cumulative counters of its heartbeat
    decoded_tokens_total: int = 0

    @property
    def in_flight(self) -> int:
        return self.waiting_prefill + self.running_decode + self.held_kv_handles


@dataclass(frozen=True, slots=True)
class Fleet:
    now_s: float
    engines: tuple[EngineState, ...]
    new_tokens_total: int = 0  # the turns' new tokens the environments routed (cumulative)
    turns_total: int = 0  # the turns the environments routed (cumulative)

    def count(self, role: Role) -> int:
        return sum(e.role is role for e in self.engines)

    @property
    def mean_decode_context_tokens(self) -> float:
        seqs = sum(e.running_decode for e in self.engines)
        return sum(e.decode_context_tokens for e in self.engines) / seqs if seqs else DEFAULT_CONTEXT_TOKENS

    @property
    def kv_working_set_tokens(self) -> int:
        """KV the fleet holds now, resident and cached: live trajectories between turns, and the
        cached prefixes of finished ones until eviction drops them (a warm fleet reads full)."""
        return sum(e.kv_held_tokens for e in self.engines)

    @property
    def waiting_prefill_tokens(self) -> int:
        return sum(e.waiting_prefill_tokens for e in self.engines)

    @property
    def running_decode(self) -> int:
        return sum(e.running_decode for e in self.engines)

    @property
    def token_totals(self) -> tuple[int, int, int]:
        """(prefill tokens computed, decode tokens generated) by every engine since it started,
        and the turns' new tokens routed."""
        return sum(e.prefilled_tokens_total for e in self.engines), sum(e.decoded_tokens_total for e in self.engines), self.new_tokens_total


@dataclass(frozen=True, slots=True)
class Demand:
    """Demand over the decision horizon."""

    prefill_tokens_per_s: float  # prefill compute asked for (cache-missed tokens)
    decode_seqs: float  # sequences decoding at once
    decode_context_tokens: float = DEFAULT_CONTEXT_TOKENS  # their mean context
    source: str = ""  # "queues", "forecast", "oracle"
    remote_share: float = 1.0  # share of prefill tokens too long to prefill where their KV lives
    kv_working_set_tokens: float = 0.0  # KV the fleet holds now (`Fleet.kv_working_set_tokens`)
    prefill_new_tokens_per_s: float = 0.0  # the turns' new tokens alone (0: unknown, take prefill_tokens_per_s)
    live_trajectories: float = 0.0  # trajectories live now (decoding, queued or in a tool call)
    # KV tokens they hold: histories and the prefilled tokens of the turns they are in (the
    # forecaster's lifecycle state, `LiveState.live_context_tokens`; 0: not known), recorded
    # with each decision beside `kv_working_set_tokens`, which also counts the cached prefixes
    # of finished trajectories (loads.working_set_tokens)
    live_context_tokens: float = 0.0
    # the two figures above are the lifecycle state's (a forecast's or a recorded log's), so 0
    # means none live (between sync steps), not unknown
    live_known: bool = False
    # the mean context a cache-missed prefill token attends over (its prefix, and the tokens
    # before it in its own prefill), from the forecast prefill engine-seconds: prices the
    # prefill tokens (`Capacity.prefill_s_at`); 0: unknown, priced at the typical context
    prefill_attention_tokens: float = 0.0
    # the part of `prefill_tokens_per_s` that is work queued now (backlog / horizon), not the
    # horizon's flow: an arrangement's prefill work per new token is read on the flow alone
    prefill_backlog_tokens_per_s: float = 0.0
    # the live trajectories' mean model seconds of work left at the pace of now (the
    # forecaster's `remaining_s`; the oracle's from the recorded log); 0: not known
    remaining_s: float = 0.0
    # a live turn's mean seconds queued and prefilling, decoding, and in its tool call, at the
    # pace of now (the forecaster's; 0s: not known)
    turn_stage_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    turn_prefill_tokens: float = 0.0  # an append's mean cache-missed prefill tokens (the forecaster's; 0: not known)
    # the arrangement `turn_stage_s` and `remaining_s` were timed in (prefill engines, 0: colocated;
    # -1: the fleet's of now). The oracle's are a recorded run's, timed in that run's arrangement
    stages_timed_in: int = -1

    @property
    def prefill_flow_tokens_per_s(self) -> float:
        """The horizon's prefill flow, without the backlog of now."""
        return max(0.0, self.prefill_tokens_per_s - self.prefill_backlog_tokens_per_s)

    @property
    def live_kv_known(self) -> bool:
        """Whether `live_context_tokens` is the live trajectories' KV (0 included: none live),
        not a figure nobody stated."""
        return self.live_known or self.live_context_tokens > 0

    @property
    def decoding_kv_tokens(self) -> float:
        """KV of the sequences decoding at once, at their mean context."""
        return self.decode_seqs * self.decode_context_tokens

    def over_work_left(self) -> Demand | None:
        """The live trajectories' mean demand while their work left lasts, by Little's law:
        each spends the decode stage's share of its turn decoding and sends an append's
        prefill tokens once a turn; no backlog (what is queued now is in the horizon's
        demand). None where the turn's stages or its prefill size are not known."""
        turn_s = sum(self.turn_stage_s)
        if turn_s <= 0 or self.turn_prefill_tokens <= 0 or self.live_trajectories <= 0:
            return None
        flow = self.live_trajectories * self.turn_prefill_tokens / turn_s
        new_share = self.prefill_new_tokens_per_s / self.prefill_flow_tokens_per_s if self.prefill_flow_tokens_per_s > 0 else 0.0
        return replace(
            self,
            prefill_tokens_per_s=flow,
            prefill_backlog_tokens_per_s=0.0,
            prefill_new_tokens_per_s=flow * new_share,
            decode_seqs=self.live_trajectories * self.turn_stage_s[1] / turn_s,
        )

    def with_prefill_flow(self, flow_tokens_per_s: float) -> Demand:
        """This demand with another prefill flow; the backlog of now stays."""
        return replace(self, prefill_tokens_per_s=flow_tokens_per_s + self.prefill_backlog_tokens_per_s)


@dataclass(frozen=True, slots=True)
class RoleChange:
    engine_id: str
    role: Role
    why: str = ""
