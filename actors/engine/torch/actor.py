"""The engine actor with the `torch` backend: real tensors behind the same bus protocol.

What changes against the emulated engine (`actor.py`):

* start: load the checkpoint, compare model config and tokenizer with the trainer's
  (`subjects.train_model()`); any difference stops the engine with a message naming it.
* prefill: `TorchBackend` computes the KV on top of the trajectory's cached prefix and samples
  the first token; the decode work carries it (`first_token_id`, `first_logprob`).
* KV hand-off: the decode engine asks `subjects.kv(holder)` for chunk 0 with `have_tokens`
  (what its own prefix cache already holds), then for the other chunks at once; it checks
  the CRC-32C of the whole payload, rebuilds the cache and joins the decode batch. The holder
  serialises, checksums and encodes the replies when it hands the turn off
  (`_prepare_transfer`), from the position a decode engine most likely holds; a fetch from
  there only sends, one from elsewhere is serialised then. At most
  KV_FETCHES_IN_FLIGHT transfers run at once (2 where the holder, the bus and this engine
  each have a core, else 1: more only share the same link and loop, each slower); a
  transfer's duration is timed from its first request to its KV ready. The reply's bytes
  are read as a view (`KvChunkView`) and copied once, into the block the KV tensors view.
  An unknown or expired handle, an unreachable holder, a short or corrupt payload: the turn
  goes back to prefill (counted), never decoded on wrong KV.
* Joining the batch: before a step, the decode engine waits for transfers in flight to land
  (at most one step's duration, KV_JOIN_WAIT_WALL_S when nothing runs), so turns that arrive
  together decode together instead of one decode chunk apart: a decode step costs about the
  same for one row as for many.
* LoadPolicy(v): fetch v's weights from the trainer in chunks, verify, load, drop older KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from functools import partial

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from actors.engine.actor import EngineActor
from actors.engine.core import Seq
from actors.engine.handoff import KV_REQUEST_TIMEOUT_WALL_S
from actors.engine.torch.backend import TorchBackend
from actors.engine.torch.kv import KvChunkView, KvError, Outgoing, kv_slice
from actors.engine.torch.model import (
    checksum,
    kv_checksum,
    kv_checksum_matches,
    load_model,
    load_tokenizer,
    model_spec,
    spec_differences,
    split_chunks,
)
from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.lifecycle import EventKind
from bus_schemas.train import ModelSpec, ModelSpecRequest, WeightsChunk, WeightsFetch
from bus_schemas.work import DecodeWork, KvChunk, KvFetch, KvHandle, PrefillWork, TurnResult

SPEC_RETRY_WALL_S = 0.2
WEIGHTS_TIMEOUT_WALL_S = 30.0


def _kv_fetches_in_flight() -> int:
    """Two transfers at once overlap one's serialisation with the other's time on the bus, which
    pays only when the holder, the bus server and the requester each have a core. On 2 CPUs
    (measured, 1 MB transfers) two at once time-slice: each took twice as long (14-18 ms
    instead of 6-8 ms) and the whole batch no less time."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return 2 if cpus >= 4 else 1


KV_FETCHES_IN_FLIGHT = _kv_fetches_in_flight()
KV_JOIN_WAIT_WALL_S = 0.25  # longest wait for landing transfers before a step when no row is decoding


class ModelMismatch(RuntimeError):
    """The engine's model or tokenizer is not the trainer's."""


class TorchEngineActor(EngineActor):
    migrates_decodes = False  # a switch lets every in-flight decode finish here (no mid-turn KV move yet)

    def __init__(self, actor_id, config, nc, clock, role, lm=None, tokenizer=None) -> None:
        super().__init__(actor_id, config, nc, clock, role)
        self.core.allow_preemption = False  # recompute preemption has no real KV behind it here
        if config.engines.kv_writeback == "store":
            raise ValueError('engines.kv_writeback = "store" is modelled by the emulated backend only; the torch backend has "to-prefill"')
        mc = config.model
        if lm is None:
            lm = load_model(mc.checkpoint, mc.threads)
            tokenizer = load_tokenizer(mc.checkpoint)
        self.tokenizer = tokenizer
        self.torch = TorchBackend(actor_id, lm, tokenizer, mc, clock, clock.time_scale, config.run.seed)
        self.backend = self.torch
        self.spec = model_spec(lm, tokenizer)
        self._outgoing: dict[str, Outgoing] = {}
        self._prepared: dict[str, Outgoing] = {}  # held KV, its chunk replies encoded at hand-off
        self._kv_slots = asyncio.Semaphore(KV_FETCHES_IN_FLIGHT)
        self._landed_events: list[partial] = []  # KV_TRANSFER_DONE events not yet emitted (`_emit_landed`)

    def on_interrupted(self, cut: list, version: int) -> None:
        """engines.inflight_on_update = "interrupt": every cut turn loses its KV of the old
        weights and keeps its tokens; waiting turns take the new version."""
        for seq in cut:
            self.torch.cut(seq.key, version)
        for seq in self.core.waiting:
            state = self.torch.states.get(seq.key)
            if state is not None and state.kv is None:
                state.version = seq.work.policy_version

    # --- start: same model as the trainer -----------------------------------------------------
    async def setup(self) -> None:
        if self.config.model.verify_trainer:
            theirs = await self._trainer_spec()
            differences = spec_differences(self.spec, theirs)
            if differences:
                raise ModelMismatch(
                    f"engine {self.actor_id} refuses to start: its model differs from the trainer's: " + "; ".join(differences)
                )
        await super().setup()

    async def _trainer_spec(self) -> ModelSpec:
        deadline_s = self.clock.now_s() + self.config.model.trainer_wait_wall_s * self.clock.time_scale  # model seconds
        request = encode(ModelSpecRequest(requester_id=self.actor_id))
        while True:
            try:
                reply = await self.nc.request(subjects.train_model(), request, timeout=self.clock.loop_s(2.0))
                spec = self.decode_or_count(ModelSpec, reply)
                if spec is not None:
                    return spec
            except (NoRespondersError, TimeoutError):
                pass
            if self.clock.now_s() > deadline_s:
                raise ModelMismatch(f"no trainer answered on {subjects.train_model()} within {self.config.model.trainer_wait_wall_s} s")
            await self.clock.sleep_wall(SPEC_RETRY_WALL_S)  # the trainer is still starting

    # --- prefill -------------------------------------------------------------------------------
    def _check_work(self, work: PrefillWork) -> str | None:
        if len(work.context_token_ids) != work.context_tokens or len(work.token_ids) != work.new_tokens or not work.token_ids:
            return (
                f"token ids do not match the counts (context {len(work.context_token_ids)}/{work.context_tokens}, "
                f"new {len(work.token_ids)}/{work.new_tokens})"
            )
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in work.token_ids) or any(not 0 <= t < vocab for t in work.context_token_ids):
            return f"token id outside the vocabulary (0..{vocab - 1})"
        if work.max_output_tokens < 1:
            return "max_output_tokens < 1"
        return None

    def _admitted(self, seq: Seq) -> None:
        with self.core.ledger.changing(seq):  # the real prefix hit replaces the core's count
            self.torch.admit_prefill(seq)

    async def _before_step(self) -> bool:
        """Let KV transfers in flight land, so their turns join the next decode step."""
        try:
            return await self._join_transfers()
        finally:
            self._emit_landed()  # before the step: a turn's kv_transfer_done precedes its decode_started

    async def _join_transfers(self) -> bool:
        if self._pending_transfers == 0:
            return False
        wait_wall_s = min(KV_JOIN_WAIT_WALL_S, self.torch.last_step_wall_s) if self.core.running else KV_JOIN_WAIT_WALL_S
        deadline_s = self.clock.now_s() + wait_wall_s * self.clock.time_scale  # model seconds
        while self._pending_transfers > 0 and not self.stopping.is_set():
            left_s = deadline_s - self.clock.now_s()
            if left_s <= 0:
                self.counters["kv_join_waits_cut"] += 1
                break
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), timeout=self.clock.to_wall_s(left_s))
        return True

    def _decode_item(self, seq: Seq, handle: KvHandle, at_s: float) -> DecodeWork:
        tokens = seq.work.context_tokens + seq.work.new_tokens
        handle = msgspec.structs.replace(handle, tokens=tokens, kv_bytes=tokens * self.torch.kv_bytes_per_token)
        self._prepare_transfer(seq.key, max(0, seq.work.context_tokens - 1))
        first, logprob = self.torch.first_token(seq.key)
        return DecodeWork(
            prefill=seq.work,
            kv=handle,
            first_token_id=first,
            first_logprob=logprob,
            cached_prefix_tokens=seq.cached_prefix_tokens,
            prefilled_at_s=at_s,
        )

    def _turn_result(self, seq: Seq, at_s: float) -> TurnResult:
        token_ids, logprobs = self.torch.finish(seq)
        return msgspec.structs.replace(super()._turn_result(seq, at_s), token_ids=token_ids, logprobs=logprobs)

    # --- KV hand-off, prefill side ---------------------------------------------------------------
    def _prepare_transfer(self, handle_id: str, from_tokens: int) -> None:
        """Serialise, checksum and encode the held KV's replies now, at hand-off, from the position
        a decode engine most likely holds (nothing on a first turn; else the turns before less
        the last generated token, which had no KV when that engine cached them), so that such a
        fetch only sends. Measured (1 MiB, 2 CPUs): export 0.35 + CRC 0.46 + encode 0.1 ms that
        were in each fetch; it costs a copy of the KV, held until the fetch or the TTL."""
        try:
            payload, tokens, kv_sum = self.torch.held_wire(handle_id, from_tokens)
        except KvError:
            return
        out = self._outgoing_of(payload, tokens, kv_sum, from_tokens)
        out.replies = [encode(self._chunk(handle_id, out, i)) for i in range(len(out.replies))]  # bytes no longer viewed
        self._prepared[handle_id] = out

    def _outgoing_of(self, payload: memoryview, tokens: int, kv_sum: str, start_tokens: int) -> Outgoing:
        chunks = split_chunks(payload, self.config.model.kv_chunk_bytes)
        return Outgoing(replies=chunks, checksum=kv_sum, tokens=tokens, start_tokens=start_tokens, total_bytes=len(payload))

    async def _on_kv_fetch(self, msg: Msg) -> None:
        request = self.decode_or_count(KvFetch, msg)
        if request is None:
            reply = encode(KvChunk(handle_id="", ok=False, error="malformed KV fetch"))
        elif request.chunk == 0 and request.handle_id in self._writebacks:
            reply = self._start_writeback_transfer(request)
        elif request.chunk == 0:
            reply = self._start_transfer(request)
        else:
            reply = self._next_chunk(request)
        if msg.reply:
            await msg.respond(reply)

    def _start_transfer(self, request: KvFetch) -> bytes:
        handle_id, have = request.handle_id, request.have_tokens
        seq = self.core.release(handle_id, self.clock.now_s())
        prepared = self._prepared.pop(handle_id, None)
        self._room.set()
        if seq is None:
            self.torch.drop(handle_id)
            self.counters["kv_unknown_handle"] += 1
            return encode(KvChunk(handle_id=handle_id, ok=False, error="unknown or expired KV handle"))
        try:
            if prepared is not None and prepared.start_tokens == have:
                self.torch.release(handle_id, have)
                out = prepared
                self.counters["kv_served_prepared"] += 1
            else:
                out = self._outgoing_of(*self.torch.export(handle_id, have), have)
                self.counters["kv_served_serialised_at_fetch"] += 1
        except KvError as err:  # the held sequence is gone either way
            self.counters["kv_refused"] += 1
            return encode(KvChunk(handle_id=handle_id, ok=False, error=str(err)))
        out.expires_at_s = self.clock.now_s() + self.config.engines.kv_ttl_s
        self._outgoing[handle_id] = out
        self.counters["kv_bytes_served"] += out.total_bytes
        return self._chunk_reply(handle_id, out, 0)

    def _next_chunk(self, request: KvFetch) -> bytes:
        out = self._outgoing.get(request.handle_id)
        if out is None or not 0 <= request.chunk < len(out.replies):
            self.counters["kv_unknown_handle"] += 1
            return encode(KvChunk(handle_id=request.handle_id, ok=False, error=f"no chunk {request.chunk} behind this handle"))
        return self._chunk_reply(request.handle_id, out, request.chunk)

    def _chunk_reply(self, handle_id: str, out: Outgoing, i: int) -> bytes:
        out.served.add(i)
        if len(out.served) == len(out.replies):
            del self._outgoing[handle_id]
        reply = out.replies[i]
        return reply if isinstance(reply, bytes) else encode(self._chunk(handle_id, out, i))

    @staticmethod
    def _chunk(handle_id: str, out: Outgoing, i: int) -> KvChunk:
        return KvChunk(
            handle_id=handle_id,
            ok=True,
            chunk=i,
            n_chunks=len(out.replies),
            tokens=out.tokens,
            kv_bytes=out.total_bytes,
            checksum=out.checksum,
            data=out.replies[i],
            start_tokens=out.start_tokens,
        )

    def _expire_held(self) -> None:
        self._expire_writebacks()
        now_s = self.clock.now_s()
        for seq in self.core.expire(now_s):
            self._prepared.pop(seq.key, None)
            self.torch.drop(seq.key)
            self.counters["kv_expired"] += 1
            self.log.warning("KV of %s expired before a decode engine fetched it", seq.key)
        for handle_id in [h for h, out in self._outgoing.items() if out.expires_at_s < now_s]:
            del self._outgoing[handle_id]
            self.counters["kv_transfers_abandoned"] += 1

    # --- KV write-back (engines.kv_writeback = "to-prefill"), see actors.engine.writeback ----------
    def _writeback_source(self, seq: Seq) -> tuple[int, list[int], object]:
        """The ids and KV `finish` left in the prefix cache: the turn's whole sequence but its last
        sampled token (no KV yet). The hold keeps a reference to the tensors."""
        source = self.torch.writeback_source(seq.work.trajectory_id, seq.work.policy_version)
        if source is None:
            return 0, [], None
        ids, kv = source
        return len(ids), ids, kv

    def _kv_bytes_per_token(self) -> int:
        return self.torch.kv_bytes_per_token

    def _start_writeback_transfer(self, request: KvFetch) -> bytes:
        """Serve a held write-back from the requester's `have_tokens` on, in checksummed chunks."""
        hold = self._writebacks.pop(request.handle_id)
        have = request.have_tokens
        if hold.expires_at_s < self.clock.now_s() or not 0 <= have <= hold.tokens:
            self.counters["kv_writeback_refused_fetch"] += 1
            error = f"write-back expired or have_tokens {have} outside 0..{hold.tokens}"
            return encode(KvChunk(handle_id=request.handle_id, ok=False, error=error))
        payload = self.torch.kv_to_bytes(kv_slice(hold.kv, have, hold.tokens))
        out = self._outgoing_of(payload, hold.tokens - have, kv_checksum(payload), have)
        out.expires_at_s = self.clock.now_s() + self.config.engines.kv_ttl_s
        self._outgoing[request.handle_id] = out
        self.counters["kv_writeback_served"] += 1
        self.counters["kv_bytes_served"] += out.total_bytes
        return self._chunk_reply(request.handle_id, out, 0)

    def _writeback_have(self, notice) -> int:
        if notice.policy_version != self.torch.version or len(notice.token_ids) != notice.kv.tokens:
            return notice.kv.tokens  # unusable here: fetch nothing (frees the hold)
        return self.torch.writeback_have(notice.trajectory_id, notice.policy_version, list(notice.token_ids))

    async def _writeback_transfer(self, notice, have: int) -> tuple[str | None, int, bool]:
        """Fetch positions have.. over NATS (chunked, CRC-32C checked), then land them on the
        cached prefix; the fetch shares the hand-off's transfer slots."""
        tokens = notice.kv.tokens - have
        async with self._kv_slots:
            error, payload = await self._fetch_kv(notice.kv, have, tokens)
        if error is not None or tokens == 0:
            return error, 0, False
        if self.core.in_flight(notice.trajectory_id):
            return None, len(payload), False
        try:
            landed = self.torch.land_writeback(notice.trajectory_id, notice.policy_version, list(notice.token_ids), have, payload)
        except KvError as err:
            return f"written-back KV unusable: {err}", 0, False
        return None, len(payload), landed

    # --- KV hand-off, decode side ----------------------------------------------------------------
    async def _pull_kv(self, item: DecodeWork, msg: Msg) -> None:
        try:
            w = item.prefill
            if w.policy_version != self.torch.version:
                self.counters["kv_stale_version"] += 1
                await self._reprefill(w, f"decode work of policy {w.policy_version} on an engine at {self.torch.version}")
                await msg.ack()
                return
            ids = list(w.context_token_ids) + list(w.token_ids)
            async with self._kv_slots:
                have = self.torch.local_prefix_tokens(w.trajectory_id, w.policy_version, ids)
                started_s = self.clock.now_s()
                error, payload = await self._fetch_kv(item.kv, have, len(ids) - have)
                target = None
                if error is None:
                    error = self._stale_on_landing(w.policy_version)
                if error is None:
                    try:
                        target = self.torch.admit_decode(w.work_id, w, item.first_token_id, item.first_logprob, have, payload)
                    except KvError as err:
                        error = f"KV from {item.kv.engine_id} unusable: {err}"
                duration_s = self.clock.now_s() - started_s  # model seconds, request to KV ready
            if error is not None:
                await self._reprefill(w, error)
                await msg.ack()
                return
            seq = self.core.admit_decode(item)
            seq.target_tokens = target
            self._msgs[seq.key] = msg
            self.counters["kv_bytes_fetched"] += len(payload)
            self.counters["kv_tokens_reused"] += have
            self._landed_events.append(
                partial(  # stamped now, emitted by `_emit_landed`
                    self._turn_event,
                    EventKind.KV_TRANSFER_DONE,
                    seq,
                    self.clock.now_s(),
                    role=self.core.role.value,
                    kv_bytes=len(payload),
                    duration_s=duration_s,
                )
            )
        finally:
            self._pending_transfers -= 1
            if self._pending_transfers == 0:
                self._emit_landed()
            self._wake.set()
            self._progress.set()

    def _emit_landed(self) -> None:
        """Emit the kv_transfer_done events held back while other transfers were in flight or
        waiting: each is a JetStream publish (stored with fsync) on this engine's connection, and
        one sent between two transfers slowed the next by ~0.9 ms (1 MiB, 2 CPUs, measured).
        Emitted when no transfer is left, and before every step (so within one step's time)."""
        events, self._landed_events = self._landed_events, []
        for emit in events:
            emit()

    async def _fetch_kv(self, handle: KvHandle, have: int, tokens: int) -> tuple[str | None, bytearray]:
        """All chunks of the KV behind `handle` from position `have` on, checked; or why not.
        Each chunk is a view into its reply; they are copied once, into the block the KV
        tensors then view."""
        first, error = await self._kv_request(handle, 0, have)
        if error is not None:
            return error, bytearray()
        rest = await asyncio.gather(*(self._kv_request(handle, i, have) for i in range(1, first.n_chunks)))
        for _, err in rest:
            if err is not None:
                return err, bytearray()
        if first.tokens != tokens or first.start_tokens != have:
            return f"KV holder {handle.engine_id} sent tokens {first.start_tokens}+{first.tokens}, wanted {have}+{tokens}", bytearray()
        chunks = [first.data, *(chunk.data for chunk, _ in rest)]
        size = sum(len(c) for c in chunks)
        if size == first.kv_bytes == tokens * self.torch.kv_bytes_per_token and kv_checksum_matches(chunks, first.checksum):
            return None, bytearray().join(chunks)  # one allocation, one copy (no zero fill first)
        self.counters["kv_checksum_mismatch"] += 1
        return f"KV from {handle.engine_id} failed its checksum ({size} of {first.kv_bytes} bytes)", bytearray()

    async def _kv_request(self, handle: KvHandle, chunk: int, have: int) -> tuple[KvChunkView | None, str | None]:
        request = KvFetch(handle_id=handle.handle_id, chunk=chunk, requester_id=self.actor_id, have_tokens=have)
        try:
            reply = await self.nc.request(subjects.kv(handle.engine_id), encode(request), timeout=KV_REQUEST_TIMEOUT_WALL_S)
        except (NoRespondersError, TimeoutError) as err:
            return None, f"KV holder {handle.engine_id} unreachable: {err!r}"
        answer = self.decode_or_count(KvChunkView, reply)
        if answer is None:
            return None, f"malformed KV reply from {handle.engine_id}"
        if not answer.ok:
            return None, f"KV holder {handle.engine_id}: {answer.error}"
        if answer.chunk != chunk or answer.handle_id != handle.handle_id:
            return None, f"KV holder {handle.engine_id} answered chunk {answer.chunk} of {answer.handle_id!r}"
        return answer, None

    async def _reprefill(self, work: PrefillWork, why: str) -> None:
        self.torch.drop(work.work_id)
        await super()._reprefill(work, why)

    # --- policy versions ---------------------------------------------------------------------------
    def _weight_sync_s(self) -> float:
        return 0.0  # the fetch below takes what it really takes

    async def _load_weights(self, version: int) -> str | None:
        first, error = await self._weights_request(version, 0)
        if error is not None:
            return error
        rest = [await self._weights_request(version, i) for i in range(1, first.n_chunks)]
        for _, err in rest:
            if err is not None:
                return err
        payload = b"".join([first.data, *(chunk.data for chunk, _ in rest)])
        if len(payload) != first.total_bytes or checksum(payload) != first.checksum:
            self.counters["weights_checksum_mismatch"] += 1
            return f"weights of policy {version} failed their checksum"
        dropped = await self.torch.load_weights(payload, version)
        self.counters["kv_prefixes_dropped_stale"] += dropped
        self.counters["weights_bytes_loaded"] += len(payload)
        self.log.info("loaded policy %d (%d bytes); dropped %d stale cached prefixes", version, len(payload), dropped)
        return None

    async def _weights_request(self, version: int, chunk: int) -> tuple[WeightsChunk | None, str | None]:
        request = encode(WeightsFetch(version=version, chunk=chunk, requester_id=self.actor_id))
        try:
            reply = await self.nc.request(subjects.train_weights(), request, timeout=WEIGHTS_TIMEOUT_WALL_S)
        except (NoRespondersError, TimeoutError) as err:
            return None, f"weights of policy {version} unavailable: {err!r}"
        answer = self.decode_or_count(WeightsChunk, reply)
        if answer is None or not answer.ok or answer.chunk != chunk or answer.version != version:
            return None, f"weights of policy {version}, chunk {chunk}: {answer.error if answer else 'malformed reply'}"
        return answer, None
