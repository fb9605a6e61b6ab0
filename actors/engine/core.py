"""The engine's scheduler core (pure: no bus, no clock; times are passed in).

One `plan` / `complete` pair is one scheduler step of continuous batching:

  1. decode: every running sequence generates one token per iteration;
  2. prefill: the waiting sequences' uncached tokens fill the rest of the token budget in
     chunks (first come, first served);
  3. a decode-only batch may advance several iterations at once, up to the next sequence
     that finishes or `max_advance_s`, so a long decode costs few loop turns; so may a
     batch whose prefill chunks would be planned again unchanged (`repeat_prefill`);
  4. `complete` applies the step and returns what finished.

Roles: `prefill` holds the KV of a prefilled turn for a decode engine (`hold` / `release`);
`decode` admits prefilled turns whose KV arrived (`admit_decode`); `colocated` does both
on one engine. A prefix cache (LRU, in the free part of the KV pool) keyed by trajectory
and policy version turns a returning trajectory's history into cached-prefix tokens; a
task's first prompt is cached once for its GRPO siblings (`prompt_key`). It is one cache
per engine, and a turn may land on any DP rank: SGLang keeps a radix cache per rank, and a
router that pins each trajectory to the rank holding its prefix (SGLang's dp-aware
routing) gets the hits modelled here. With a host tier, KV that leaves the GPU moves to
host memory and is copied back over the host link when needed (`host_copy_s`).
"""

from __future__ import annotations

from collections import deque

import msgspec

from actors.engine.admission import (
    RESERVED_DECODE_TOKENS,
    RETRACT_DECODE_STEPS,
    NewTokenRatio,
    growth_tokens,
    init_ratio,
    rank_chunk_tokens,
)
from actors.engine.emulated.costmodel import CostPreset, RankLoad, group_decode_run_s, group_iteration_s, host_copy_s
from actors.engine.kv_ledger import KvLedger
from actors.engine.prefix_lru import PrefixLru, key
from actors.engine.sequence import HELD, RUNNING, WAITING, Batch, Held, Seq
from actors.engine.timing import FULL_KV_SHARE, IterationMeter
from bus_schemas.control import Role
from bus_schemas.work import DecodeWork, PrefillWork

KV_HIGH_WATERMARK = 0.9  # stop admitting work above this share of the KV pool
# SGLang's --prefill-delayer-max-delay-passes default (server_args.py): new prefills wait at
# most this many passes less one in a row
PREFILL_DELAYER_MAX_DELAY_PASSES = 30
# Seq's token properties as plain functions: `sum(map(_KV_TOKENS, seqs))` adds up a batch
# without a generator frame per sequence (these sums run several times per step)
_KV_TOKENS = Seq.kv_tokens.fget
_KV_RESERVED_TOKENS = Seq.kv_reserved_tokens.fget
_DECODE_LEFT = Seq.decode_left.fget


def prompt_key(work: PrefillWork) -> str:
    """The prefix cache's key for a task's first prompt, shared by its GRPO siblings."""
    return key("prompt:" + work.prompt_key, work.policy_version)


class EngineCore:
    def __init__(
        self,
        engine_id: str,
        role: Role,
        preset: CostPreset,
        max_batch_tokens: int,
        max_decode_seqs: int,
        max_waiting: int,
        admission: str = "sglang",
        host_kv_ratio: float = 0.0,
        divide_chunk: bool = False,
        prefill_delayer: bool = False,
        prior: CostPreset | None = None,
    ) -> None:
        self.engine_id = engine_id
        # the cost model the engine is priced with, where it runs another (`engines.truth`):
        # every step is also timed by it, for the iteration times the engine reports
        # (`timing`); None: the engine runs the model it is priced with
        self.prior = prior
        self.timing = IterationMeter()
        self.admission = admission  # "sglang": reserve KV for decode growth (actors/engine/admission.py); "vllm": greedy
        self.new_token_ratio = NewTokenRatio()
        self.hold_new_handoffs = False  # sglang PD: the decode side takes no work now, start no new hand-off prefill (the actor sets it)
        self.role = role
        self.max_batch_tokens = max_batch_tokens
        self.divide_chunk = divide_chunk  # SGLang under DP attention: each rank's chunk is max_batch_tokens / dp
        # host KV tier (`engines.host_kv_tier`), `host_kv_ratio` times the GPU pool: out of room,
        # a decode's KV is parked in host memory (`_retract_to_host`) and an evicted prefix moves
        # there, both copied back when needed; without it (0), KV that does not fit is dropped
        # and computed again
        self.prefill_delayer = prefill_delayer  # SGLang's PrefillDelayer (`_delays_new_prefills`)
        self._delayed_passes = 0  # consecutive passes it held new prefills back
        self.delayed_passes = 0  # in all, for the run's counters
        self.host_kv_ratio = host_kv_ratio
        self.host_tier = host_kv_ratio > 0
        self.prefixes = PrefixLru()  # in the free part of the KV pool, then in host memory
        self.ledger = KvLedger()  # the KV of every sequence here, by place and rank, kept current
        self._host_copy_tokens = [0]  # per rank: KV to copy to or from host before the next step
        self.preset = preset
        self.max_decode_seqs = max_decode_seqs
        self.max_waiting = max_waiting
        self.waiting: deque[Seq] = deque()
        self.running: dict[str, Seq] = {}
        self.retracted: deque[Seq] = deque()  # decodes whose KV waits in host memory (`_retract_to_host`)
        self.held: dict[str, Held] = {}
        self.busy_s = 0.0  # modelled time spent in steps, for utilisation
        self.preemptions = 0
        self.preempted_kv_tokens = 0  # KV dropped by preemptions, to be computed again
        self.retractions = 0  # decodes whose KV went to host memory (`_retract_to_host`)
        self.retracted_kv_tokens = 0  # ... and its tokens
        self.host_loaded_kv_tokens = 0  # cached prefixes loaded back from the host tier
        self.prompt_cached_tokens = 0  # first prompts served from a sibling's KV
        self.allow_preemption = True  # backends without recompute support turn it off
        self._admitted = 0  # admission counter: newest sequences are preempted first
        self._order: dict[str, int] = {}

    @property
    def preset(self) -> CostPreset:
        return self._preset

    @preset.setter
    def preset(self, preset: CostPreset) -> None:
        """The cost model of the engine's layout (a role switch may change it, and with it the pools)."""
        self._preset = preset
        self.prefixes.host_capacity_tokens = int(self.host_kv_ratio * preset.kv_capacity_tokens)
        if self.new_token_ratio.init != init_ratio(preset.dp_ranks):
            self.new_token_ratio.start_from(init_ratio(preset.dp_ranks))
        self.ledger.fit_ranks(preset.dp_ranks)
        if len(self._host_copy_tokens) != preset.dp_ranks:  # copies still due go to the first rank of the new layout
            self._host_copy_tokens = [sum(self._host_copy_tokens)] + [0] * (preset.dp_ranks - 1)

    @property
    def rank_chunk_tokens(self) -> int:
        """Each DP rank's chunked-prefill budget per iteration."""
        return rank_chunk_tokens(self.max_batch_tokens, self.preset.dp_ranks, self.divide_chunk)

    @property
    def _prefill_first(self) -> bool:
        """SGLang's prefill-first scheduling on a DP-attention engine (mixed chunk off)."""
        return self.preset.dp_sync == "sglang" and self.preset.dp_ranks > 1 and not self.preset.mixed_chunk

    # --- capacity ------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.preset.kv_capacity_tokens

    @property
    def kv_used_tokens(self) -> int:
        """KV allocated or reserved: the waiting sequences' whole prompts, the others' KV."""
        return self.kv_resident_tokens + sum(self.ledger.left[WAITING])

    @property
    def kv_resident_tokens(self) -> int:
        """KV actually allocated now (admission reservations of unprefilled tokens excluded)."""
        kv = self.ledger.kv
        return sum(kv[WAITING]) + sum(kv[RUNNING]) + sum(kv[HELD])

    @property
    def waiting_prefill_tokens(self) -> int:
        """Prefill tokens the waiting sequences have still to compute."""
        return sum(self.ledger.left[WAITING])

    def counted_kv_tokens(self) -> tuple[int, int]:
        """(kv_used_tokens, kv_resident_tokens) added up over every sequence, as the ledger
        keeps them (for checking it)."""
        held = sum(h.seq.kv_tokens for h in self.held.values())
        running = sum(map(_KV_TOKENS, self.running.values()))
        return (
            sum(map(_KV_RESERVED_TOKENS, self.waiting)) + running + held,
            sum(map(_KV_TOKENS, self.waiting)) + running + held,
        )

    def room(self, pending: int = 0) -> int:
        """Sequences this engine may pull now (`pending`: admitted elsewhere, not yet here)."""
        if self.kv_used_tokens >= KV_HIGH_WATERMARK * self.kv_capacity_tokens:
            return 0
        return self._room_by_count(pending)

    def has_room(self, pending: int = 0) -> bool:
        """`room(pending) > 0`, the resident KV counted last (a pass over every sequence here):
        an engine whose queue is full says no on its counts alone."""
        return self._room_by_count(pending) > 0 and self.kv_used_tokens < KV_HIGH_WATERMARK * self.kv_capacity_tokens

    def _room_by_count(self, pending: int) -> int:
        """`room` below the KV watermark."""
        max_waiting = self.max_waiting * self.preset.dp_ranks
        max_decode = self.max_decode_seqs * self.preset.dp_ranks
        if self.role is Role.PREFILL:
            return max_waiting - len(self.waiting) - pending
        if self.retracted:  # SGLang: no new request while a retracted one waits for room
            return 0
        if self.role is Role.DECODE:  # prefills here are short local appends (per-turn placement)
            if self.admission == "sglang" and self._decode_reserve_full(pending):
                return 0
            return min(max_decode - len(self.running) - len(self.waiting), max_waiting - len(self.waiting)) - pending
        return min(max_waiting - len(self.waiting), max_decode - len(self.running) - len(self.waiting)) - pending

    def _decode_reserve_full(self, pending: int) -> bool:
        """SGLang's PD decode engine: no room once the free KV is down to its reservation
        for every request running, waiting or on its way here."""
        requests = len(self.running) + len(self.waiting) + pending
        return self.kv_used_tokens + RESERVED_DECODE_TOKENS * requests >= self.kv_capacity_tokens

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.retracted

    @property
    def decoding(self) -> list[Seq]:
        """Every sequence in its decode here: running, or retracted with its KV in host memory."""
        return [*self.running.values(), *self.retracted]

    def holds(self, key: str) -> bool:
        return key in self.running or key in self.held or any(s.key == key for s in [*self.waiting, *self.retracted])

    # --- admission -----------------------------------------------------------------------
    def admit_prefill(self, work: PrefillWork) -> Seq:
        on_gpu, in_host = self.prefixes.take_split(work.trajectory_id, work.policy_version)
        cached = min(on_gpu + in_host, work.context_tokens)
        rank = self._least_loaded_rank()
        prompt_tokens = 0
        if work.context_tokens == 0 and work.prompt_key:  # a first turn whose prompt a sibling may have left here
            on_gpu, in_host = self.prefixes.peek(prompt_key(work))
            prompt_tokens = min(on_gpu + in_host, work.new_tokens - 1)  # the last token is computed for its logits
            cached = prompt_tokens
        self._host_copy_tokens[rank] += min(in_host, cached)  # a prefix from the host tier is loaded back first
        self.host_loaded_kv_tokens += min(in_host, cached)
        self.prompt_cached_tokens += prompt_tokens
        seq = Seq(
            work=work,
            target_tokens=max(1, work.target_output_tokens),
            cached_prefix_tokens=cached,
            prefill_tokens=work.context_tokens + work.new_tokens - cached,
            handoff=self.role is Role.PREFILL,
            prefill_engine_id=self.engine_id,
            rank=rank,
        )
        self._note_admission(seq)
        self.waiting.append(seq)
        self.ledger.enter(seq, WAITING)
        return seq

    def _least_loaded_rank(self) -> int:
        """The rank whose waiting and running sequences reserve the least KV (the first of equals)."""
        if self.preset.dp_ranks == 1:
            return 0
        kv, left = self.ledger.kv, self.ledger.left
        load = [kv[WAITING][r] + left[WAITING][r] + kv[RUNNING][r] + left[RUNNING][r] for r in range(self.preset.dp_ranks)]
        return min(range(len(load)), key=load.__getitem__)

    def _note_admission(self, seq: Seq) -> None:
        self._admitted += 1
        self._order[seq.key] = self._admitted

    def admit_decode(self, item: DecodeWork) -> Seq:
        """A prefilled turn whose KV has arrived: all of its context is resident."""
        work = item.prefill
        self.prefixes.take(work.trajectory_id, work.policy_version)
        seq = Seq(
            work=work,
            target_tokens=max(1, work.target_output_tokens),
            cached_prefix_tokens=item.cached_prefix_tokens,
            prefill_tokens=work.context_tokens - item.cached_prefix_tokens + work.new_tokens,
            handoff=False,
            prefill_done_tokens=work.context_tokens - item.cached_prefix_tokens + work.new_tokens,
            generated=max(1, item.generated_tokens),  # the first token was sampled at the end of prefill
            prefill_started=True,
            decode_started=item.generated_tokens > 1,  # migrated mid-turn: its decode started elsewhere
            prefill_engine_id=item.kv.engine_id,
            rank=self._least_loaded_rank(),
            oldest_version=item.oldest_policy_version,
        )
        self._note_admission(seq)
        self.running[seq.key] = seq
        self.ledger.enter(seq, RUNNING)
        return seq

    # --- one scheduler step --------------------------------------------------------------
    def plan(self, max_advance_s: float, repeat_prefill: bool = False) -> Batch | None:
        """The next step. `repeat_prefill`: a step whose prefill chunks all continue (none
        finishes, each fills its rank's budget) may cover several identical iterations, as a
        decode-only step does; for backends that model time rather than run tokens."""
        resident = self._preempt_to_fit(1)
        if self._resume_retracted():
            resident = self.kv_resident_tokens
        decode = list(self.running.values())
        ranks = self.preset.dp_ranks
        budget = [self.rank_chunk_tokens] * ranks
        for seq in decode:
            budget[seq.rank] -= 1
        free = self.kv_capacity_tokens - resident - len(decode)  # prefill only into free KV
        free_before_chunks = free
        room_for_new = None  # SGLang: worked out at the first new request (it needs the whole batch's growth)
        delay = bool(decode) and self._delays_new_prefills()
        chunks: list[tuple[Seq, int]] = []
        for seq in self.waiting:
            if seq.preempted and seq.prefill_done_tokens == 0 and seq.prefill_left > free:
                continue  # recompute a preempted sequence only once all of it fits again
            if seq.handoff and seq.prefill_done_tokens == 0 and self.hold_new_handoffs:
                continue  # no decode engine could take its KV yet
            if (self.retracted or delay) and seq.prefill_done_tokens == 0 and not seq.preempted:
                continue  # a retracted request waits at the queue's head (SGLang); or the PrefillDelayer holds new work
            if seq.prefill_done_tokens == 0 and self.admission == "sglang":  # SGLang: a new request fits with its growth
                if room_for_new is None:
                    room_for_new = self._room_for_new(free_before_chunks)
                need = seq.prefill_left + self._growth(seq)
                if need > room_for_new and (self.running or chunks):  # alone, it starts whatever its growth
                    room_for_new = -1.0  # first come, first served: nothing after it starts either
                    continue
                room_for_new -= need
            n = min(budget[seq.rank], seq.prefill_left, free)
            if n == seq.prefill_left and n + 1 > free:
                n -= 1  # finishing also samples a token, whose KV needs a slot too
            if n > 0:
                chunks.append((seq, n))
                budget[seq.rank] -= n
                free -= n + (n == seq.prefill_left)
        prefilling: set[int] = set()
        if chunks and self._prefill_first:  # SGLang: a rank that prefills runs no decode that step
            prefilling = {seq.rank for seq, _ in chunks}
            decode = [s for s in decode if s.rank not in prefilling]
        if not chunks and not decode:
            if not self.waiting and not self.running:
                self.new_token_ratio.reset()  # SGLang: an idle scheduler starts again from INIT
            partial = [s for s in self.waiting if s.prefill_done_tokens > 0]
            if len(partial) > 1 and self.allow_preemption:  # part-filled prefills block each other
                self._evict(max(partial, key=lambda s: self._order.get(s.key, 0)))
                return self.plan(max_advance_s, repeat_prefill)
            return None
        ends_s = None
        decoding = self._decode_per_rank(prefilling)
        if chunks:
            repeats = self._repeatable(chunks, decode, budget, free) if repeat_prefill else 1
            ends_s, total_s, prior_s = [], 0.0, 0.0
            for ahead in range(repeats):  # each repeat's chunks and decodes sit on a longer context
                loads = self._loads(chunks, decoding, ahead)
                total_s += group_iteration_s(self.preset, loads)
                if ends_s and total_s > max_advance_s:
                    break
                ends_s.append(total_s)
                if self.prior is not None:
                    prior_s += group_iteration_s(self.prior, loads)
            iterations, duration_s = len(ends_s), ends_s[-1]
        else:
            loads = self._loads([], decoding)
            one_s = group_iteration_s(self.preset, loads)
            fit = int(max_advance_s // one_s) if one_s > 0 else 1
            if delay:  # each pass is the delayer's to count: stop where it would let prefill through
                fit = min(fit, PREFILL_DELAYER_MAX_DELAY_PASSES - 1 - self._delayed_passes)
            free = self.kv_capacity_tokens - resident  # nothing changed since it was counted
            iterations = max(1, min(fit, free // len(decode), min(map(_DECODE_LEFT, decode))))
            duration_s = group_decode_run_s(self.preset, loads, iterations)
            if self.prior is not None:
                prior_s = group_decode_run_s(self.prior, loads, iterations)
        self._count_delay(delay, iterations)
        copy_s = self._take_host_copy_s()
        if ends_s is not None:
            ends_s = [e + copy_s for e in ends_s]
        started: list[tuple[str, Seq]] = []
        for seq, _ in chunks:
            if not seq.prefill_started:
                seq.prefill_started = True
                started.append(("prefill_started", seq))
        for seq in decode:
            if not seq.decode_started:
                seq.decode_started = True
                started.append(("decode_started", seq))
        batch = Batch(chunks, decode, iterations, duration_s + copy_s, started, ends_s, copy_s)
        batch.kv_full = resident >= FULL_KV_SHARE * self.kv_capacity_tokens
        if self.prior is not None:
            batch.prior_s = prior_s + copy_s
        return batch

    def _delays_new_prefills(self) -> bool:
        """SGLang's PrefillDelayer (`engines.prefill_delayer`; prefill_delayer.py, not on PD
        decode servers): each pass the DP ranks share whether each has a new request to
        prefill. When some do and some do not ("mixed"), new prefills wait, at most
        PREFILL_DELAYER_MAX_DELAY_PASSES − 1 passes in a row, so that the ranks prefill in the
        same step rather than one rank's prefill stalling every rank's decode; when all or none
        do, nothing waits. Prefills already under way (chunked) continue either way. The
        token-usage watermark that would let a nearly empty rank through is off by default, as
        here. An engine with nothing else to run does not wait (its passes take no time)."""
        ranks = self.preset.dp_ranks
        if not self.prefill_delayer or ranks == 1 or self.role is Role.DECODE:
            return False
        new = {seq.rank for seq in self.waiting if seq.prefill_done_tokens == 0}
        return 0 < len(new) < ranks and self._delayed_passes < PREFILL_DELAYER_MAX_DELAY_PASSES - 1

    def _count_delay(self, delayed: bool, passes: int) -> None:
        if delayed:
            self._delayed_passes += passes
            self.delayed_passes += passes
        else:
            self._delayed_passes = 0

    def _growth(self, seq: Seq) -> float:
        """KV a sequence is expected to still need for its output (none: it hands off)."""
        return 0.0 if seq.handoff else growth_tokens(seq.max_new_tokens, seq.generated, self.new_token_ratio.current)

    def _room_for_new(self, free: int) -> float:
        """SGLang: the free KV less the expected growth of every sequence that decodes here
        (running, or part-way through its prefill), summed in that order (`_growth` inlined)."""
        started = [s for s in self.waiting if s.prefill_done_tokens > 0]
        ratio = self.new_token_ratio.current
        growth = (
            0.0 if s.handoff else growth_tokens(s.work.max_output_tokens or s.target_tokens, s.generated, ratio)  # (Seq.max_new_tokens)
            for s in [*self.running.values(), *started]
        )
        return free - sum(growth)

    def _repeatable(self, chunks: list[tuple[Seq, int]], decode: list[Seq], budget: list[int], free: int) -> int:
        """How many iterations would plan exactly these chunks again: none finishes its prefill,
        each took its rank's whole budget (not one limited by free KV), no decode finishes
        before the last, and the KV of every repeat fits (`free`: what the first leaves)."""
        if any(budget[seq.rank] != 0 for seq, _ in chunks):
            return 1
        repeats = min((seq.prefill_left - 1) // n for seq, n in chunks)
        if decode:
            repeats = min(repeats, max(1, min(map(_DECODE_LEFT, decode))))
        return max(1, min(repeats, 1 + free // (sum(n for _, n in chunks) + len(decode))))

    def _decode_per_rank(self, skip_ranks: set[int]) -> tuple[list[int], list[int]]:
        """Each rank's running sequences and their KV context tokens, none on `skip_ranks`."""
        ranks = self.preset.dp_ranks
        count, kv = self.ledger.count[RUNNING], self.ledger.kv[RUNNING]
        if ranks == 1:
            return [sum(count)], [sum(kv)]
        return (
            [0 if r in skip_ranks else count[r] for r in range(ranks)],
            [0 if r in skip_ranks else kv[r] for r in range(ranks)],
        )

    def _loads(self, chunks: list[tuple[Seq, int]], decoding: tuple[list[int], list[int]], ahead: int = 0) -> list[RankLoad]:
        """Each rank's work in an iteration, `ahead` repeats of these chunks from now (every
        decode's context is then `ahead` tokens longer). `decoding`: `_decode_per_rank`."""
        seqs, context = decoding
        prefill: list[list[tuple[int, int]]] = [[] for _ in range(self.preset.dp_ranks)]
        for seq, n in chunks:
            prefill[seq.rank].append((n, seq.cached_prefix_tokens + seq.prefill_done_tokens + ahead * n))
        return [RankLoad(tuple(prefill[r]), seqs[r], context[r] + ahead * seqs[r]) for r in range(self.preset.dp_ranks)]

    def _preempt_to_fit(self, iterations: int) -> int:
        """Free KV for `iterations` of decode growth: the newest sequence holding KV (running, or
        part-way through its prefill) loses it and is recomputed later (recompute preemption).
        A PD decode engine under SGLang retracts to host memory instead (`_retract_to_host`).
        Returns the KV resident afterwards (`kv_resident_tokens`)."""
        while self.allow_preemption and self.running:
            resident = self.kv_resident_tokens
            if resident + len(self.running) * iterations <= self.kv_capacity_tokens:
                return resident
            if self.host_tier:
                self._retract_to_host()
                return self.kv_resident_tokens
            holders = [*self.running.values(), *(s for s in self.waiting if s.prefill_done_tokens > 0)]
            self._evict(max(holders, key=lambda s: self._order.get(s.key, 0)))
            stay = list(self.running.values())
            self.new_token_ratio.after_preemption([s.generated for s in stay], [s.max_new_tokens for s in stay])
        return self.kv_resident_tokens

    def _retract_to_host(self) -> None:
        """An engine with a host KV tier out of KV, as SGLang's PD decode server does
        (`retract_decode`, disaggregation_mode "decode"; a colocated server with the
        hierarchical cache keeps a retracted request's KV in host memory likewise): it retracts requests until the rest have room for RETRACT_DECODE_STEPS more tokens each,
        the fewest tokens generated first (longest input among equals); each one's KV is copied
        to host memory (`Req.offload_kv_cache`) and copied back once it fits again with its
        reservation (`resume_retracted_reqs`), never recomputed. sglang python/sglang/srt/
        managers/schedule_batch.py and disaggregation/decode.py."""
        while self.running and self.kv_resident_tokens + len(self.running) * RETRACT_DECODE_STEPS > self.kv_capacity_tokens:
            victim = min(self.running.values(), key=lambda s: (s.generated, -s.kv_tokens))
            del self.running[victim.key]
            self.ledger.leave(victim)
            self.retracted.append(victim)
            self._host_copy_tokens[victim.rank] += victim.kv_tokens
            self.retractions += 1
            self.retracted_kv_tokens += victim.kv_tokens
        stay = list(self.running.values())
        self.new_token_ratio.after_preemption([s.generated for s in stay], [s.max_new_tokens for s in stay])

    def _resume_retracted(self) -> bool:
        """Retracted decodes come back in order while each fits with its reservation beside the
        reservations of every request here (SGLang `resume_retracted_reqs`). True if any came back."""
        resumed = False
        while self.retracted:
            seq = self.retracted[0]
            requests = len(self.running) + len(self.waiting)
            free = self.kv_capacity_tokens - self.kv_used_tokens - RESERVED_DECODE_TOKENS * requests
            if seq.kv_tokens + RESERVED_DECODE_TOKENS > free and (self.running or self.waiting):
                break  # alone, it comes back whatever its size
            self.retracted.popleft()
            self.running[seq.key] = seq
            self.ledger.enter(seq, RUNNING)
            self._host_copy_tokens[seq.rank] += seq.kv_tokens
            resumed = True
        return resumed

    def _take_host_copy_s(self) -> float:
        """The host copies due before the next step: the slowest rank's (each rank has its own
        link; the group's next iteration waits for every rank)."""
        busiest = max(self._host_copy_tokens)
        if busiest == 0:
            return 0.0
        self._host_copy_tokens = [0] * self.preset.dp_ranks
        return host_copy_s(self.preset, busiest)

    def _evict(self, victim: Seq) -> None:
        """Drop a sequence's KV; it is recomputed once all of it fits again."""
        self.preempted_kv_tokens += victim.kv_tokens
        self.ledger.leave(victim)  # running, or waiting part-way through its prefill
        if victim.key in self.running:
            del self.running[victim.key]
            victim.prefill_tokens = victim.kv_tokens
            victim.generated_before_prefill = victim.generated
            self.waiting.appendleft(victim)
        else:
            victim.prefill_tokens += victim.cached_prefix_tokens
        victim.cached_prefix_tokens = 0
        victim.prefill_done_tokens = 0
        victim.preempted = True
        self.ledger.enter(victim, WAITING)
        self.preemptions += 1

    def complete(self, batch: Batch) -> list[tuple[str, Seq]]:
        """Apply a planned step; return ("prefill_done" | "decode_done", seq) in order."""
        self.busy_s += batch.duration_s
        self.timing.count(batch, self.rank_chunk_tokens)
        if batch.decode:
            self.new_token_ratio.decay(batch.iterations)
        done: list[tuple[str, Seq]] = []
        running, iterations, ledger = self.running, batch.iterations, self.ledger
        running_kv = ledger.kv[RUNNING]
        for seq in batch.decode:  # every decoding sequence, every step: kept to plain attribute reads
            if running.get(seq.work.work_id) is not seq:  # (Seq.key)
                continue  # migrated away during the step: the new engine redoes those tokens
            generated = seq.generated + iterations
            if generated < seq.target_tokens:
                seq.generated = generated
                running_kv[seq.rank] += iterations  # its KV grew by a token an iteration (the ledger's one direct change)
            else:  # its last token (capped at the target)
                ledger.leave(seq)
                seq.generated = seq.target_tokens
                del self.running[seq.key]
                self._order.pop(seq.key, None)
                self._cache_put(seq.work.trajectory_id, seq.work.policy_version, seq.kv_tokens)
                done.append(("decode_done", seq))
        for seq, n in batch.prefill:
            with ledger.changing(seq):
                seq.prefill_done_tokens += n * batch.iterations
            if seq.prefill_left > 0:
                continue
            self.waiting.remove(seq)
            ledger.leave(seq)
            seq.preempted = False
            if seq.generated_before_prefill > 0:  # recomputed after a preemption: back to decoding, no new event
                seq.prefill_tokens -= seq.generated_before_prefill
                seq.prefill_done_tokens = seq.prefill_tokens
                seq.generated_before_prefill = 0
                self.running[seq.key] = seq
                ledger.enter(seq, RUNNING)
                continue
            seq.generated = 1  # first token sampled at the end of prefill
            if seq.work.prompt_key and seq.work.context_tokens == 0:  # its siblings may reuse the prompt's KV here
                self.prefixes.put_key(prompt_key(seq.work), seq.work.new_tokens, self.kv_capacity_tokens - self.kv_used_tokens)
            done.append(("prefill_done", seq))
            if not seq.handoff:
                self.running[seq.key] = seq
                ledger.enter(seq, RUNNING)
        return done

    # --- leaving a role (a switch's deadline) ---------------------------------------------
    def detach_running(self) -> list[Seq]:
        """Every decoding sequence, taken out of the batch (its KV stays resident until held
        or dropped): what a switching engine migrates to another decode engine."""
        seqs = self.decoding
        for seq in self.running.values():
            self.ledger.leave(seq)
        self.running.clear()
        self.retracted.clear()
        for seq in seqs:
            self._order.pop(seq.key, None)
        return seqs

    def hand_off_waiting(self) -> None:
        """Becoming a prefill engine: every waiting sequence hands its KV over once prefilled."""
        for seq in self.waiting:
            if seq.generated_before_prefill == 0:  # a preempted decode recomputes, then decodes here
                seq.handoff = True

    # --- a weight update mid-rollout (run.mode = "async") -----------------------------------
    def interrupt(self, version: int) -> list[Seq]:
        """engines.inflight_on_update = "interrupt", at an iteration boundary: every admitted
        sequence (running, or waiting with KV) loses its KV of the old version and is recomputed
        under `version` with its tokens so far (recompute preemption); every waiting one is
        restamped with `version`; the prefix cache of older versions goes. Held KV keeps its
        version (a decode engine at another version refuses it). Returns the sequences cut."""
        cut = []
        while self.retracted:  # their KV in host memory is of the old version too
            seq = self.retracted.popleft()
            self.running[seq.key] = seq
            self.ledger.enter(seq, RUNNING)
        for seq in list(self.running.values()):
            self._evict(seq)
            cut.append(seq)
        for seq in self.waiting:
            if seq not in cut and (seq.prefill_done_tokens > 0 or seq.cached_prefix_tokens > 0):
                self._evict(seq)
                cut.append(seq)
        self.preemptions -= len(cut)  # not a KV shortage
        for seq in self.waiting:
            old = seq.work.policy_version
            if old < version:
                if seq.generated > 0 and seq.oldest_version < 0:
                    seq.oldest_version = old  # tokens of the old policy stay in the turn
                seq.work = msgspec.structs.replace(seq.work, policy_version=version)
        self.drop_cache_below(version)
        return cut

    def drop_cache_below(self, version: int) -> int:
        """Forget every cached prefix of a policy older than `version`; returns entries dropped."""
        return self.prefixes.drop_below(version)

    # --- KV hand-off (prefill role) ------------------------------------------------------
    def hold(self, seq: Seq, handle_id: str, expires_at_s: float) -> None:
        self.held[handle_id] = Held(seq, expires_at_s)
        self.ledger.enter(seq, HELD)

    def release(self, handle_id: str, now_s: float) -> Seq | None:
        """A decode engine took the KV; keep the prefix cached. None if unknown or expired."""
        held = self.held.pop(handle_id, None)
        if held is None:
            return None
        seq = held.seq
        self.ledger.leave(seq)
        self._cache_put(seq.work.trajectory_id, seq.work.policy_version, seq.kv_tokens - seq.generated)
        if held.expires_at_s < now_s:
            return None
        return seq

    def expire(self, now_s: float) -> list[Seq]:
        expired = [h for h in self.held if self.held[h].expires_at_s < now_s]
        gone = [self.held.pop(h).seq for h in expired]
        for seq in gone:
            self.ledger.leave(seq)
        return gone

    # --- prefix cache --------------------------------------------------------------------
    def _cache_put(self, trajectory_id: str, policy_version: int, tokens: int) -> None:
        """Cache a prefix in the free part of the pool (LRU entries make room)."""
        self.prefixes.put(trajectory_id, policy_version, tokens, self.kv_capacity_tokens - self.kv_used_tokens)

    @property
    def cached_tokens(self) -> int:
        return self.prefixes.tokens

    def cached_prefix(self, trajectory_id: str, policy_version: int) -> int:
        """Tokens the prefix cache holds for (trajectory, version), without taking them."""
        return self.prefixes.get(trajectory_id, policy_version)

    def extend_prefix(self, trajectory_id: str, policy_version: int, from_tokens: int, tokens: int) -> bool:
        """Written-back KV landed (`engines.kv_writeback`): the cached prefix of (trajectory,
        version), which held `from_tokens` when the transfer began, now holds `tokens`. Other
        entries are evicted (LRU) to make room; an entry that alone does not fit goes too.
        False, and nothing changes, when the entry no longer holds `from_tokens` (taken by a
        turn admitted meanwhile, or evicted) or already holds `tokens`."""
        have = self.cached_prefix(trajectory_id, policy_version)
        if have < from_tokens or have >= tokens or (from_tokens == 0 and self.in_flight(trajectory_id)):
            return False
        self._cache_put(trajectory_id, policy_version, tokens)
        return self.cached_prefix(trajectory_id, policy_version) == tokens

    def in_flight(self, trajectory_id: str) -> bool:
        """A turn of the trajectory is admitted here (its prefix already taken from the cache):
        waiting, running or held."""
        return trajectory_id in self.ledger.trajectories
