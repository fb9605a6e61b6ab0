"""How an engine turns finished steps into effects and moves KV (a mixin of EngineActor).

* prefill side: a prefilled turn's KV is held under a handle with a TTL (`_hold`), its
  decode work is queued, and the KV is served to the decode engine that asks
  (`_on_kv_fetch` on `prorsa.kv.<engine>`);
* decode side: the KV is fetched (`_pull_kv`); when it is gone the turn goes back to
  prefill (`_reprefill`), never on to decode on missing KV;
* a switch's hand-off: running decodes move to another engine with their KV
  (`migrate_decodes`);
* every result and work item is published durably before its input is acked.
"""

from __future__ import annotations

import asyncio

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from actors.base.publish import PublishAborted, publish_durable
from actors.engine.core import Seq
from actors.engine.emulated.costmodel import transfer_s
from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.lifecycle import EventKind
from bus_schemas.work import DecodeWork, KvChunk, KvFetch, KvHandle, PrefillWork, TurnResult, retry_work_id

KV_REQUEST_TIMEOUT_WALL_S = 5.0


class EngineHandoff:
    """Needs the EngineActor attributes: core, config, js, nc, clock, link, counters, log,
    stopping, epoch, _msgs, _effects, _pending_transfers, _wake, _room, _progress,
    spawn(), decode_or_count(), _turn_event(), _work_event()."""

    # --- effects -------------------------------------------------------------------------
    async def _hand_off(self, seq: Seq, at_s: float) -> None:
        """Hold the KV under a handle, queue the decode work, then ack the prefill work."""
        try:
            item = self._decode_item(seq, self._hold(seq, at_s), at_s)
            await self._publish(subjects.work_decode(), encode(item), seq.key)
            self._turn_event(EventKind.DECODE_QUEUED, seq, self.clock.now_s())
            await self._ack(seq.key)
        finally:
            self._effects -= 1

    def _hold(self, seq: Seq, at_s: float) -> KvHandle:
        """Keep `seq`'s KV for a decode engine to fetch, under a handle with a TTL."""
        kv_tokens = seq.kv_tokens - 1  # the last sampled token has no KV yet
        handle = KvHandle(
            engine_id=self.actor_id,
            handle_id=seq.key,
            tokens=kv_tokens,
            kv_bytes=kv_tokens * self.core.preset.kv_bytes_per_token,
            expires_at_s=at_s + self.config.engines.kv_ttl_s,
        )
        self.core.hold(seq, handle.handle_id, handle.expires_at_s)
        return handle

    async def migrate_decodes(self) -> int:
        """A switch's hand-off: every decoding sequence goes to the decode queue with its KV
        held here (fetched like a fresh hand-off) and the tokens generated so far. Returns
        how many moved. Its original work item is acked once the new one is stored."""
        now_s = self.clock.now_s()
        seqs = self.core.detach_running()
        self._wake.set()  # a decode step in progress ends at its next iteration
        for seq in seqs:
            item = DecodeWork(
                prefill=seq.work,
                kv=self._hold(seq, now_s),
                cached_prefix_tokens=seq.cached_prefix_tokens,
                prefilled_at_s=now_s,
                generated_tokens=seq.generated,
                migrated_from=self.actor_id,
                oldest_policy_version=seq.oldest_version,
            )
            await self._publish(subjects.work_decode(), encode(item), f"{seq.key}/mig{self.epoch}")
            await self._ack(seq.key)
            self.counters["decodes_migrated"] += 1
        return len(seqs)

    def _decode_item(self, seq: Seq, handle: KvHandle, at_s: float) -> DecodeWork:
        return DecodeWork(prefill=seq.work, kv=handle, cached_prefix_tokens=seq.cached_prefix_tokens, prefilled_at_s=at_s)

    def _turn_result(self, seq: Seq, at_s: float) -> TurnResult:
        w = seq.work
        return TurnResult(
            work_id=w.work_id,
            trajectory_id=w.trajectory_id,
            turn=w.turn,
            policy_version=w.policy_version,
            prefill_engine_id=seq.prefill_engine_id,
            decode_engine_id=self.actor_id,
            output_tokens=seq.generated,
            cached_prefix_tokens=seq.cached_prefix_tokens,
            finished_at_s=at_s,
            oldest_policy_version=seq.oldest_version,
        )

    async def _return_result(self, seq: Seq, at_s: float) -> None:
        try:
            w = seq.work
            result = self._turn_result(seq, at_s)
            self._after_turn(seq, at_s)  # KV write-back, if configured (off the critical path)
            await self._publish(subjects.result(w.env_id), encode(result), w.work_id)
            await self._ack(seq.key)
        finally:
            self._effects -= 1

    async def _publish(self, subject: str, data: bytes, msg_id: str) -> None:
        try:
            await publish_durable(self.js, subject, data, msg_id, self.counters, self.log, self.stopping, self.clock)
        except PublishAborted as err:  # input stays un-acked: teardown returns it to the queue
            self.log.warning("%s", err)
            raise asyncio.CancelledError from err

    async def _ack(self, key: str) -> None:
        msg = self._msgs.pop(key, None)
        if msg is not None:
            await msg.ack()

    # --- KV hand-off, decode side ----------------------------------------------------------
    async def _pull_kv(self, item: DecodeWork, msg: Msg) -> None:
        try:
            if item.prefill.policy_version < self.policy_version:  # KV of an older policy: never reused
                self.counters["kv_stale_version"] += 1
                await self._reprefill(item.prefill, f"KV of policy {item.prefill.policy_version} on an engine at {self.policy_version}")
                await msg.ack()
                return
            error, chunk = await self._request_kv(item.kv)
            if error is not None:
                await self._reprefill(item.prefill, error)
                await msg.ack()
                return
            duration_s = transfer_s(self.link, chunk.kv_bytes)
            await self.clock.sleep(duration_s)
            stale = self._stale_on_landing(item.prefill.policy_version)
            if stale is not None:
                await self._reprefill(item.prefill, stale)
                await msg.ack()
                return
            seq = self.core.admit_decode(item)
            self._msgs[seq.key] = msg
            kind = EventKind.DECODE_MIGRATED if item.migrated_from else EventKind.KV_TRANSFER_DONE
            self._turn_event(kind, seq, self.clock.now_s(), kv_bytes=chunk.kv_bytes, duration_s=duration_s, detail=item.migrated_from)
        finally:
            self._pending_transfers -= 1
            self._wake.set()
            self._progress.set()

    def _stale_on_landing(self, policy_version: int) -> str | None:
        """Why KV of `policy_version` that has just landed must not be admitted: a weight update
        began or finished while it was on the wire (an interrupting update cuts only the turns
        already admitted, so one admitted after the cut would decode on the new weights over
        the old version's KV). Counted; None when it is current."""
        now = max(self.policy_version, self._interrupting_to)
        if policy_version >= now:
            return None
        self.counters["kv_stale_version"] += 1
        return f"KV of policy {policy_version} landed after an update to {now} began"

    async def _request_kv(self, handle: KvHandle, request: KvFetch | None = None) -> tuple[str | None, KvChunk | None]:
        """One KV request to the engine holding `handle` (the whole hand-off unless `request`
        says otherwise: a write-back asks for what the prefill side lacks); (error, chunk)."""
        request = request or KvFetch(handle_id=handle.handle_id, requester_id=self.actor_id)
        try:
            reply = await self.nc.request(subjects.kv(handle.engine_id), encode(request), timeout=KV_REQUEST_TIMEOUT_WALL_S)
        except (NoRespondersError, TimeoutError) as err:
            return f"KV holder {handle.engine_id} unreachable: {err}", None
        chunk = self.decode_or_count(KvChunk, reply)
        if chunk is None:
            return f"malformed KV reply from {handle.engine_id}", None
        if not chunk.ok:
            return f"KV holder {handle.engine_id}: {chunk.error}", None
        return None, chunk

    async def _reprefill(self, work: PrefillWork, why: str) -> None:
        """The KV is gone: send the turn back to prefill, never continue on missing KV."""
        again = msgspec.structs.replace(work, attempt=work.attempt + 1, work_id=retry_work_id(work.work_id, work.attempt + 1))
        self.counters["reprefills"] += 1
        self.log.warning("re-prefill %s: %s", work.work_id, why)
        await self._publish(subjects.work_prefill(), encode(again), again.work_id)
        self._work_event(EventKind.REPREFILL, again, detail=why, new_tokens=again.new_tokens, context_tokens=again.context_tokens)

    # --- KV hand-off, prefill side ---------------------------------------------------------
    async def _on_kv_fetch(self, msg: Msg) -> None:
        request = self.decode_or_count(KvFetch, msg)
        if request is None:
            reply = KvChunk(handle_id="", ok=False, error="malformed KV fetch")
        elif request.handle_id in self._writebacks:
            reply = self._serve_writeback(request)
        else:
            seq = self.core.release(request.handle_id, self.clock.now_s())
            if seq is None:
                self.counters["kv_unknown_handle"] += 1
                reply = KvChunk(handle_id=request.handle_id, ok=False, error="unknown or expired KV handle")
            else:
                tokens = seq.kv_tokens - 1  # the last sampled token has no KV yet
                reply = KvChunk(
                    handle_id=request.handle_id,
                    ok=True,
                    tokens=tokens,
                    kv_bytes=tokens * self.core.preset.kv_bytes_per_token,
                )
            self._room.set()
        if msg.reply:
            await msg.respond(encode(reply))

    def _expire_held(self) -> None:
        self._expire_writebacks()
        for seq in self.core.expire(self.clock.now_s()):
            self.counters["kv_expired"] += 1
            self.log.warning("KV of %s expired before a decode engine fetched it", seq.key)
            self._room.set()
