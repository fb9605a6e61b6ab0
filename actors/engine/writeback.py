"""KV write-back from decode to the prefill side (`engines.kv_writeback`, docs/writeback.md).

In PD, the KV of the tokens a decode engine generates lives on that engine; without a path
back, the next turn's prefill engine recomputes them. Two paths, both off the critical path:

* ``"to-prefill"`` (vLLM's prefill-pulls-from-decode, PR #32553): when a decode engine
  finishes a turn it holds the turn's KV under a handle with the hand-off TTL
  (`WritebackHold`) and sends a `KvWriteback` notice (request/reply on
  `subjects.kv_writeback(<prefill engine>)`) to the engine that prefilled the turn
  (`Seq.prefill_engine_id`); a short append the decode engine prefilled itself goes to the
  prefill-side engine holding the trajectory's prefix (`PrefillWork.writeback_engine_id`,
  set by the environment's router). That engine acks at once, then fetches the KV over the usual
  `subjects.kv(<decode engine>)` request/reply with `have_tokens` = the prefix it already
  holds, and on landing its prefix cache for (trajectory, policy version) extends to the
  whole context. A turn that arrives first computes what it lacks; the late write-back is
  dropped (`kv_writeback_late`). Every loss is counted and logged: a notice nobody acks
  (`kv_writeback_unacked`), a refused one (`kv_writeback_refused`), a failed fetch
  (`kv_writeback_failed`), a hold nobody fetched before its TTL (`kv_writeback_expired`).
  No trajectory depends on it: the next turn always carries its whole history.
* ``"store"`` (SGLang's decode-side offload to HiCache L3, DeepSeek's 3FS): the decode engine
  writes the KV the store lacks to a shared tier (capacity `kv_store_capacity_tokens`, oldest
  written evicted first; link `kv_store_link`) and announces it (`KvStorePut` on
  `subjects.kv_store_put()`); every engine's `StoreIndex` follows the announcements, and a
  prefill whose own cache holds less than the store loads the difference at the store link's
  cost instead of recomputing it. Emulated backend only: the store moves no bytes.

The emulated backend waits the modelled transfer (`costmodel.transfer_s`) on the hand-off
link, and the landed prefix takes its room in the prefill engine's KV pool (the prefix cache
evicts older entries for it). The torch backend moves the real tensors (`torch/actor.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from actors.engine.core import Seq
from actors.engine.emulated.costmodel import LINKS, transfer_s
from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.lifecycle import EventKind
from bus_schemas.work import KvChunk, KvFetch, KvHandle, KvStorePut, KvWriteback, KvWritebackAck, PrefillWork

NOTICE_TIMEOUT_WALL_S = 2.0  # a prefill engine acks a notice at once (before it fetches)


@dataclass(slots=True)
class WritebackHold:
    """A finished turn's KV, held on the decode engine until the prefill engine fetches it."""

    trajectory_id: str
    policy_version: int
    tokens: int  # KV positions 0..tokens
    expires_at_s: float
    token_ids: list[int]  # real backends: the ids of those positions
    kv: Any = None  # real backends: the tensors (a reference: they stay alive while held)


class StoreIndex:
    """The emulated shared KV store tier: trajectory@version -> tokens stored, under a capacity
    in tokens; the oldest written entry is evicted first. Every engine keeps one, following
    the same `KvStorePut` announcements."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.tokens = 0
        self.evicted = 0

    def get(self, trajectory_id: str, version: int) -> int:
        return self._entries.get((trajectory_id, version), 0)

    def put(self, trajectory_id: str, version: int, tokens: int) -> None:
        key = (trajectory_id, version)
        self.tokens -= self._entries.pop(key, 0)
        if tokens > self.capacity_tokens:
            return
        self._entries[key] = tokens
        self.tokens += tokens
        while self.tokens > self.capacity_tokens:
            _, old = self._entries.popitem(last=False)
            self.tokens -= old
            self.evicted += 1


class EngineWriteback:
    """Needs the EngineActor attributes: core, config, nc, clock, link, counters, log, epoch,
    policy_version, _writebacks, store, spawn(), decode_or_count(), _turn_event(), event()."""

    # --- setup ---------------------------------------------------------------------------
    def _init_writeback(self) -> None:
        ec = self.config.engines
        self.kv_writeback = ec.kv_writeback
        self._writebacks: dict[str, WritebackHold] = {}
        self._loading: set[str] = set()  # prefill work ids whose prefix is being loaded from the store
        self.store_link = LINKS[ec.kv_store_link]
        self.store = StoreIndex(ec.kv_store_capacity_tokens) if ec.kv_writeback == "store" else None

    async def _setup_writeback(self) -> None:
        if self.kv_writeback == "to-prefill":
            await self.nc.subscribe(subjects.kv_writeback(self.actor_id), cb=self._on_writeback_notice)
        elif self.kv_writeback == "store":
            await self.nc.subscribe(subjects.kv_store_put(), cb=self._on_store_put)

    # --- decode side: a turn finished ------------------------------------------------------
    def _after_turn(self, seq: Seq, at_s: float) -> None:
        """Called once a decoded turn's result is built (its KV is in this engine's cache)."""
        if self.kv_writeback == "store":
            self.spawn(self._write_to_store(seq), f"store-{seq.key}")
        elif self.kv_writeback == "to-prefill" and (target := self._writeback_target(seq)) not in ("", self.actor_id):
            self._hold_writeback(seq, target, at_s)

    def _writeback_target(self, seq: Seq) -> str:
        """The prefill-side engine a finished turn's KV goes back to: the one that prefilled it, or,
        for a short append this engine prefilled itself, the one holding the trajectory's prefix
        (`PrefillWork.writeback_engine_id`): without it, that engine's prefix stays a turn behind
        and the trajectory's next long turn recomputes the gap."""
        return seq.prefill_engine_id if seq.prefill_engine_id != self.actor_id else seq.work.writeback_engine_id

    def _writeback_source(self, seq: Seq) -> tuple[int, list[int], Any]:
        """(KV tokens, their ids, the tensors) of a finished turn (a backend hook). Emulated:
        everything but the last sampled token, which has no KV yet."""
        return max(0, seq.kv_tokens - 1), [], None

    def _hold_writeback(self, seq: Seq, target: str, at_s: float) -> None:
        tokens, token_ids, kv = self._writeback_source(seq)
        w = seq.work
        # what the target most likely holds: the turn's prompt, which it prefilled and handed
        # over; the context before the append, where this engine prefilled the append itself
        prefix = w.context_tokens + (w.new_tokens if target == seq.prefill_engine_id else 0)
        if tokens <= prefix:
            return  # nothing generated that it lacks
        handle = KvHandle(
            engine_id=self.actor_id,
            handle_id=f"{seq.key}/wb",
            tokens=tokens,
            kv_bytes=(tokens - prefix) * self._kv_bytes_per_token(),
            expires_at_s=at_s + self.config.engines.kv_ttl_s,
        )
        self._writebacks[handle.handle_id] = WritebackHold(w.trajectory_id, w.policy_version, tokens, handle.expires_at_s, token_ids, kv)
        notice = KvWriteback(
            trajectory_id=w.trajectory_id,
            turn=w.turn,
            policy_version=w.policy_version,
            kv=handle,
            prefix_tokens=prefix,
            token_ids=token_ids,
            finished_at_s=at_s,
        )
        self.counters["kv_writeback_held"] += 1
        self.spawn(self._send_notice(target, notice), f"wb-notice-{seq.key}")

    def _kv_bytes_per_token(self) -> int:
        return self.core.preset.kv_bytes_per_token

    async def _send_notice(self, prefill_engine_id: str, notice: KvWriteback) -> None:
        handle_id = notice.kv.handle_id
        try:
            reply = await self.nc.request(
                subjects.kv_writeback(prefill_engine_id), encode(notice), timeout=self.clock.loop_s(NOTICE_TIMEOUT_WALL_S)
            )
        except (NoRespondersError, TimeoutError) as err:
            self._drop_writeback(handle_id, "kv_writeback_unacked", f"no ack from {prefill_engine_id}: {err!r}")
            return
        ack = self.decode_or_count(KvWritebackAck, reply)
        if ack is None or not ack.ok:
            why = f"{prefill_engine_id} refused: {ack.error if ack else 'malformed ack'}"
            stale = ack is not None and "stale" in ack.error
            self._drop_writeback(handle_id, "kv_writeback_refused", why, warn=not stale)  # a stale one is expected at a version change

    def _drop_writeback(self, handle_id: str, counter: str, why: str, warn: bool = True) -> None:
        if self._writebacks.pop(handle_id, None) is not None:
            self.counters[counter] += 1
            (self.log.warning if warn else self.log.info)("KV write-back %s dropped: %s", handle_id, why)

    def _expire_writebacks(self) -> None:
        now_s = self.clock.now_s()
        for handle_id in [h for h, hold in self._writebacks.items() if hold.expires_at_s < now_s]:
            self._drop_writeback(handle_id, "kv_writeback_expired", "not fetched before its TTL")

    def _serve_writeback(self, request: KvFetch) -> KvChunk:
        """Emulated: the prefill engine fetches the held KV from its `have_tokens` on."""
        hold = self._writebacks.pop(request.handle_id)
        have = request.have_tokens
        if hold.expires_at_s < self.clock.now_s() or not 0 <= have <= hold.tokens:
            self.counters["kv_writeback_refused_fetch"] += 1
            return KvChunk(
                handle_id=request.handle_id, ok=False, error=f"write-back expired or have_tokens {have} outside 0..{hold.tokens}"
            )
        tokens = hold.tokens - have
        self.counters["kv_writeback_served"] += 1
        return KvChunk(handle_id=request.handle_id, ok=True, tokens=tokens, start_tokens=have, kv_bytes=tokens * self._kv_bytes_per_token())

    # --- prefill side: a notice, the fetch, the landing ----------------------------------------
    async def _on_writeback_notice(self, msg: Msg) -> None:
        notice = self.decode_or_count(KvWriteback, msg)
        if notice is None:
            ack = KvWritebackAck(ok=False, error="malformed write-back notice")
        elif notice.policy_version < self.policy_version:
            self.counters["kv_writeback_stale"] += 1
            ack = KvWritebackAck(ok=False, error=f"policy {notice.policy_version} is stale here (at {self.policy_version})")
        else:
            self.counters["kv_writeback_notices"] += 1
            ack = KvWritebackAck(ok=True)
            self.spawn(self._fetch_writeback(notice), f"wb-fetch-{notice.kv.handle_id}")
        if msg.reply:
            await msg.respond(encode(ack))

    async def _fetch_writeback(self, notice: KvWriteback) -> None:
        started_s = self.clock.now_s()
        have = self._writeback_have(notice)
        skip = ""
        if have >= notice.kv.tokens:
            skip = "kv_writeback_unneeded"  # this engine holds it all already
        elif self.core.in_flight(notice.trajectory_id):
            skip = "kv_writeback_late"  # the next turn is here already and computes what it lacks
        if skip:
            have = notice.kv.tokens  # fetch nothing: frees the decode engine's hold
        error, kv_bytes, landed = await self._writeback_transfer(notice, have)
        if error is not None:
            self.counters["kv_writeback_failed"] += 1
            self.log.warning("KV write-back of %s from %s failed: %s", notice.trajectory_id, notice.kv.engine_id, error)
            return
        if skip:
            self.counters[skip] += 1
            return
        if not landed:  # the next turn arrived during the transfer, or the prefix did not fit
            self.counters["kv_writeback_late" if self.core.in_flight(notice.trajectory_id) else "kv_writeback_not_landed"] += 1
            return
        self.counters["kv_writeback_landed"] += 1
        self.counters["kv_writeback_tokens"] += notice.kv.tokens - have
        self.counters["kv_writeback_bytes"] += kv_bytes
        self.event(
            EventKind.KV_WRITEBACK_DONE,
            trajectory_id=notice.trajectory_id,
            turn=notice.turn,
            policy_version=notice.policy_version,
            step=notice.policy_version,
            engine_id=self.actor_id,
            role=self.core.role.value,
            cached_prefix_tokens=notice.kv.tokens,
            new_tokens=notice.kv.tokens - have,
            kv_bytes=kv_bytes,
            duration_s=self.clock.now_s() - started_s,
            detail=f"to-prefill from {notice.kv.engine_id}",
        )

    def _writeback_have(self, notice: KvWriteback) -> int:
        """KV positions of the notice's sequence this engine holds already (a backend hook)."""
        return min(self.core.cached_prefix(notice.trajectory_id, notice.policy_version), notice.kv.tokens)

    async def _writeback_transfer(self, notice: KvWriteback, have: int) -> tuple[str | None, int, bool]:
        """Fetch positions have.. of the held KV and land them: (error, bytes moved, landed).
        Emulated: the reply carries the size; the transfer waits its modelled time on the link."""
        request = KvFetch(handle_id=notice.kv.handle_id, requester_id=self.actor_id, have_tokens=have)
        error, chunk = await self._request_kv(notice.kv, request)
        if error is not None:
            return error, 0, False
        if chunk.start_tokens != have or chunk.tokens != notice.kv.tokens - have:
            return f"holder sent {chunk.start_tokens}+{chunk.tokens}, wanted {have}+{notice.kv.tokens - have}", 0, False
        if chunk.tokens == 0:
            return None, 0, False
        await self.clock.sleep(transfer_s(self.link, chunk.kv_bytes))
        landed = self.core.extend_prefix(notice.trajectory_id, notice.policy_version, have, notice.kv.tokens)
        return None, chunk.kv_bytes, landed

    # --- the store tier (emulated) --------------------------------------------------------------
    async def _write_to_store(self, seq: Seq) -> None:
        """Write what the store lacks of a finished turn's KV (the modelled write, off the critical
        path), then announce it."""
        w = seq.work
        tokens, _, _ = self._writeback_source(seq)
        stored = self.store.get(w.trajectory_id, w.policy_version)
        if tokens <= stored:
            return
        kv_bytes = (tokens - stored) * self._kv_bytes_per_token()
        started_s = self.clock.now_s()
        await self.clock.sleep(transfer_s(self.store_link, kv_bytes))
        put = KvStorePut(
            trajectory_id=w.trajectory_id,
            policy_version=w.policy_version,
            tokens=tokens,
            kv_bytes=kv_bytes,
            writer_id=self.actor_id,
            at_s=self.clock.now_s(),
        )
        self.store.put(w.trajectory_id, w.policy_version, tokens)  # this engine knows at once; others by the notice
        await self.nc.publish(subjects.kv_store_put(), encode(put))
        self.counters["kv_store_writes"] += 1
        self.counters["kv_store_bytes_written"] += kv_bytes
        self._turn_event(
            EventKind.KV_WRITEBACK_DONE,
            seq,
            self.clock.now_s(),
            kv_bytes=kv_bytes,
            duration_s=self.clock.now_s() - started_s,
            detail="store",
        )

    async def _on_store_put(self, msg: Msg) -> None:
        put = self.decode_or_count(KvStorePut, msg)
        if put is not None and put.writer_id != self.actor_id:
            self.store.put(put.trajectory_id, put.policy_version, put.tokens)

    async def _load_from_store(self, work: PrefillWork) -> None:
        """Before a prefill is admitted: load from the store what it holds beyond this engine's
        own cached prefix (at the store link's cost), so the prefill computes only the rest."""
        if self.store is None:
            return
        have = self.core.cached_prefix(work.trajectory_id, work.policy_version)
        stored = min(self.store.get(work.trajectory_id, work.policy_version), work.context_tokens)
        if stored <= have:
            return
        kv_bytes = (stored - have) * self._kv_bytes_per_token()
        duration_s = transfer_s(self.store_link, kv_bytes)
        await self.clock.sleep(duration_s)
        if self.core.extend_prefix(work.trajectory_id, work.policy_version, have, stored):
            self.counters["kv_store_loads"] += 1
            self.counters["kv_store_tokens_loaded"] += stored - have
            self._work_event(
                EventKind.KV_STORE_LOADED,
                work,
                role=self.core.role.value,
                cached_prefix_tokens=stored,
                context_tokens=work.context_tokens,
                new_tokens=work.new_tokens,
                kv_bytes=kv_bytes,
                duration_s=duration_s,
            )
        else:
            self.counters["kv_store_load_dropped"] += 1
