"""The engine actor with the `vllm` backend: the same bus protocol, vLLM's scheduler inside.

vLLM batches and schedules by itself, so this actor does not plan steps with Prorsa's
scheduler core: each pulled work item becomes one vLLM request, run as its own task.

* prefill role: `VllmEngine.prefill` (the prompt's KV held by the connector under the work
  id), then a `DecodeWork` with the first token, its logprob and the KV handle, published
  durably before the prefill work is acked;
* decode role: `VllmEngine.decode` on the prompt and the first token, the KV loaded over
  NATS by the connector (anything it cannot load, vLLM recomputes: counted in the
  connector's `kv_load_failures`); the `TurnResult` carries all tokens and logprobs;
* colocated (or a turn the role prefills where its KV lives): the whole turn here;
* a role switch only changes which queues the actor pulls: the engine is built `kv_both`,
  nothing restarts, and turns in flight finish where they run (`migrates_decodes = False`);
* input vLLM cannot run (token ids outside the vocabulary, too long): the work item is
  terminated with one logged line, counted in `invalid_messages`; the engine goes on.

* `LoadPolicy(v)`: the trainer's weights of v fetched in checksummed chunks and loaded into
  vLLM in place (`VllmEngine.load_weights`); requests are then salted with v, so no KV of
  an older policy is reused. Mid-rollout (run.mode = "async"), `engines.inflight_on_update`:
  "finish" lets the running requests end on the old weights first; "interrupt" aborts them
  (`VllmEngine.cut_all`), loads, and resumes each turn on the new weights with its tokens
  so far (their KV recomputed; each token keeps the logprob of the weights that sampled it).
  A prefilled turn whose KV is of an older version than the decode engine's is prefilled
  again, never decoded on old KV.

Not here yet (docs/vllm.md): KV write-back of decoded tokens, migrating a decode mid-turn.
"""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from actors.engine.actor import EngineActor
from actors.engine.torch.model import checksum
from actors.engine.vllm.engine import BadInput, Generated, Interrupted, KvSource, VllmEngine, WeightsUnsupported
from actors.engine.vllm.steps import StepMeter
from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.control import Role
from bus_schemas.lifecycle import EventKind
from bus_schemas.status import EngineStatus
from bus_schemas.train import WeightsChunk, WeightsFetch
from bus_schemas.work import DecodeWork, KvHandle, PrefillWork, TurnResult

WEIGHTS_TIMEOUT_WALL_S = 30.0
MAX_CUTS_PER_TURN = 8  # weight updates one turn may span before it is failed (a runaway trainer)
MIN_TEMPERATURE = 0.01  # vLLM's floor for sampling; model.temperature below it decodes greedily


def model_dir(config) -> str:
    path = config.vllm.model or config.model.checkpoint
    if not path:
        raise ValueError('engines.backend = "vllm" needs vllm.model (or model.checkpoint): a local Hugging Face checkpoint dir')
    return path


def bus_url(nc) -> str:
    url = nc.connected_url
    return f"{url.scheme}://{url.hostname}:{url.port}"


def joined(first: Generated, rest: Generated) -> Generated:
    """`first`'s tokens then `rest`'s, each with its logprobs; the version of the newest, and
    the oldest version of any token if they differ (a turn a weight update cut)."""
    versions = [g.policy_version for g in (first, rest) if g.token_ids]
    versions += [g.oldest_version for g in (first, rest) if g.oldest_version >= 0]
    newest = max(versions, default=rest.policy_version)
    oldest = min(versions, default=newest)
    return Generated(
        first.token_ids + rest.token_ids,
        first.logprobs + rest.logprobs,
        first.cached_tokens,
        rest.finish_reason,
        kv_handle=rest.kv_handle or first.kv_handle,
        policy_version=newest,
        oldest_version=oldest if oldest < newest else -1,
    )


class VllmEngineActor(EngineActor):
    migrates_decodes = False  # a turn runs to its end inside vLLM; a switch waits for it

    def __init__(self, actor_id, config, nc, clock, role, engine: VllmEngine | None = None) -> None:
        super().__init__(actor_id, config, nc, clock, role)
        if config.engines.kv_writeback == "store":
            raise ValueError('engines.kv_writeback = "store" is modelled by the emulated backend only')
        self._owns_engine = engine is None  # a given engine (tests) outlives the actor
        self.vllm = engine or VllmEngine(actor_id, config.vllm, model_dir(config), bus_url(nc), role)
        self._running = {"prefill": 0, "decode": 0}
        self.steps: StepMeter | None = None  # set once the engine runs (setup)
        self._weights_taken = asyncio.Event()  # cleared while an interrupting update loads
        self._weights_taken.set()

    async def setup(self) -> None:
        if self.vllm.llm is None:
            await self.vllm.start()
        # vLLM times its own iterations: they are the steps this engine reports (heartbeat timing)
        self.steps = StepMeter(
            self.core.timing, lambda: self.core.preset, self.vllm.max_batched_tokens, self.clock.time_scale, self.vllm.decode_context_tokens
        )
        self.vllm.on_step = self.steps.record
        await super().setup()

    async def teardown(self) -> None:
        self.vllm.on_step = None  # a given engine outlives the actor
        await super().teardown()
        if self._owns_engine:
            self.vllm.shutdown()

    async def _on_kv_fetch(self, msg: Msg) -> None:
        return  # the connector inside vLLM's worker answers on subjects.kv(this engine)

    def _weight_sync_s(self) -> float:
        return 0.0  # no modelled transfer time: the fetch below takes what it really takes

    async def _load_weights(self, version: int) -> str | None:
        """The trainer's weights of `version` (chunks on subjects.train_weights, checksummed),
        loaded into vLLM in place; later requests are salted with the version."""
        chunks = []
        n_chunks = 1
        while len(chunks) < n_chunks:
            request = encode(WeightsFetch(version=version, chunk=len(chunks), requester_id=self.actor_id))
            try:
                reply = await self.nc.request(subjects.train_weights(), request, timeout=WEIGHTS_TIMEOUT_WALL_S)
            except (NoRespondersError, TimeoutError) as err:
                return f"weights of policy {version} unavailable: {err!r}"
            answer = self.decode_or_count(WeightsChunk, reply)
            if answer is None or not answer.ok or answer.chunk != len(chunks) or answer.version != version:
                return f"weights of policy {version}, chunk {len(chunks)}: {answer.error if answer else 'malformed reply'}"
            chunks.append(answer)
            n_chunks = answer.n_chunks
        payload = b"".join(c.data for c in chunks)
        if len(payload) != chunks[0].total_bytes or checksum(payload) != chunks[0].checksum:
            self.counters["weights_checksum_mismatch"] += 1
            return f"weights of policy {version} failed their checksum"
        try:
            await self.vllm.load_weights(payload, version)
        except WeightsUnsupported as err:
            return str(err)
        self.counters["weights_bytes_loaded"] += len(payload)
        self.log.info("loaded policy %d into vLLM (%d bytes)", version, len(payload))
        return None

    async def _interrupting_update(self) -> None:
        """inflight_on_update = "interrupt": abort every running request (each turn keeps its
        tokens and waits, `_generate`), load the new weights, let the turns resume."""
        version, done = self._interrupt_for
        self._interrupt_for = None
        self._weights_taken.clear()
        try:
            await self.vllm.cut_all()
            error = await self._take_weights(version)
        finally:
            self._weights_taken.set()
        if not done.done():
            done.set_result(error)

    # --- work --------------------------------------------------------------------------------
    async def _admit(self, msg: Msg, queue: str) -> None:
        if queue == "decode":
            item = await self.decode_work(DecodeWork, msg)
            if item is None:
                return
            if not self._pulling or "decode" not in self._queues():
                self.counters["returned_not_ready"] += 1
                await msg.nak()
                return
            key = f"{item.prefill.work_id}/d"  # not the prefill's key: this engine may have prefilled it
            self._start(key, msg, "decode", self._decode(item, key))
            return
        work = await self.decode_work(PrefillWork, msg)
        if work is None:
            return
        if work.policy_version > self.policy_version or not self._pulling or self._updating or not self._takes_prefill(queue):
            self.counters["returned_not_ready"] += 1
            await msg.nak(delay=0.1)
            return
        self._start(work.work_id, msg, "prefill", self._prefill(self._stamp(work)))

    def _start(self, key: str, msg: Msg, stage: str, coro) -> None:
        if key in self._msgs:  # redelivered while still running here: ack the newest delivery
            self._msgs[key] = msg
            self.counters["redelivered_in_flight"] += 1
            coro.close()
            return
        self._msgs[key] = msg
        self._pending_transfers += 1
        self._running[stage] += 1
        self.spawn(self._run(key, stage, coro), f"vllm-{stage}-{key}")

    async def _run(self, key: str, stage: str, coro) -> None:
        try:
            await coro
        except BadInput as err:
            self.counters["invalid_messages"] += 1
            self.log.error("rejected %s work %s: %s", stage, key, err)
            msg = self._msgs.pop(key, None)
            if msg is not None:
                await msg.term()
        finally:
            self._pending_transfers -= 1
            self._running[stage] -= 1
            self._room.set()
            self._progress.set()
            self._wake.set()

    def in_flight(self) -> int:
        """Work items pulled and not yet acked (benches wait for 0 before stopping the actor)."""
        return len(self._msgs)

    def _sampling(self) -> dict:
        temperature = self.config.model.temperature
        # vLLM raises a temperature below 0.01 to 0.01; below that, Prorsa means greedy
        return {"temperature": 0.0 if temperature < MIN_TEMPERATURE else temperature, "ignore_eos": not self.config.model.stop_at_eos}

    async def _prefill(self, work: PrefillWork) -> None:
        ids = list(work.context_token_ids) + list(work.token_ids)
        self._event(EventKind.PREFILL_STARTED, work)
        if self.core.role is Role.COLOCATED or self.core.role is Role.DECODE:  # the whole turn here
            gen = await self._generate(work, work.work_id, ids, work.max_output_tokens)
            self._event(EventKind.PREFILL_DONE, work, cached_prefix_tokens=gen.cached_tokens)
            self._event(EventKind.DECODE_STARTED, work)
            await self._finish(work, work.work_id, self.actor_id, gen.cached_tokens, gen)
            return
        gen = await self._generate(work, work.work_id, ids, 1, hold=work.work_id)
        if gen.policy_version != work.policy_version:  # an update cut the prefill: its KV is of the new weights
            work = msgspec.structs.replace(work, policy_version=gen.policy_version)
        now_s = self.clock.now_s()
        self._event(EventKind.PREFILL_DONE, work, cached_prefix_tokens=gen.cached_tokens)
        handle = KvHandle(
            engine_id=self.actor_id,
            handle_id=gen.kv_handle or work.work_id,
            tokens=len(ids),
            kv_bytes=0,
            expires_at_s=now_s + self.config.vllm.kv_ttl_wall_s * self.clock.time_scale,
        )
        item = DecodeWork(
            prefill=work,
            kv=handle,
            first_token_id=gen.token_ids[0],
            first_logprob=gen.logprobs[0],
            cached_prefix_tokens=gen.cached_tokens,
            prefilled_at_s=now_s,
        )
        await self._publish(subjects.work_decode(), encode(item), work.work_id)
        self._event(EventKind.DECODE_QUEUED, work)
        await self._ack(work.work_id)

    async def _decode(self, item: DecodeWork, key: str) -> None:
        work = item.prefill
        if work.policy_version < max(self.policy_version, self._interrupting_to):  # KV of an older policy: never reused
            self.counters["kv_stale_version"] += 1
            await self._reprefill(
                work, f"KV of policy {work.policy_version} on an engine at {max(self.policy_version, self._interrupting_to)}"
            )
            await self._ack(key)
            return
        ids = list(work.context_token_ids) + list(work.token_ids) + [item.first_token_id]
        first = Generated([item.first_token_id], [item.first_logprob], item.cached_prefix_tokens, None, policy_version=work.policy_version)
        self._event(EventKind.KV_TRANSFER_DONE, work, detail=item.kv.engine_id)
        self._event(EventKind.DECODE_STARTED, work)
        left_tokens = work.max_output_tokens - item.generated_tokens
        if left_tokens > 0 and not self._ends_turn(item.first_token_id):
            source = KvSource(item.kv.engine_id, item.kv.handle_id, item.kv.tokens)
            rest = await self._generate(work, key, ids, left_tokens, source=source)
            first = joined(first, rest)
        await self._finish(work, key, item.kv.engine_id, item.cached_prefix_tokens, first)

    async def _generate(
        self,
        work: PrefillWork,
        key: str,
        ids: list[int],
        n: int,
        source: KvSource | None = None,
        hold: str = "",
    ) -> Generated:
        """`n` tokens after `ids` (the KV of `ids` loaded from `source`, or held as `hold` for a
        decode engine). A weight update that cuts in (inflight_on_update = "interrupt") keeps
        the tokens so far, waits for the new weights and asks for the rest on them, the KV
        recomputed (`ids` plus the tokens so far; a hold is made again)."""
        done: Generated | None = None  # what earlier attempts generated before an update cut them
        for attempt in range(MAX_CUTS_PER_TURN + 1):
            await self._weights_taken.wait()  # a request never starts during a reload
            request_id = key if attempt == 0 else f"{key}~{attempt}"
            try:
                if hold:
                    gen = await self.vllm.prefill(request_id, ids, hold=hold, **self._sampling())
                elif source is not None:  # first attempt only: `_decode` checked the KV's version
                    gen = await self.vllm.decode(request_id, ids, n, source, **self._sampling())
                else:
                    so_far = done.token_ids if done else []
                    gen = await self.vllm.generate(request_id, ids + so_far, n - len(so_far), **self._sampling())
                return gen if done is None else joined(done, gen)
            except Interrupted as cut:
                source = None  # what is left runs on the new weights, its KV recomputed here
                partial = dataclasses.replace(cut.partial, policy_version=cut.policy_version)
                done = partial if done is None else joined(done, partial)
                self.counters["turns_interrupted"] += 1
                self._event(
                    EventKind.TURN_INTERRUPTED,
                    work,
                    generated_tokens=len(done.token_ids),
                    detail=f"policy {cut.policy_version} -> {max(self._interrupting_to, self.policy_version)}",
                )
                if len(done.token_ids) >= n:  # cut after its last token: nothing left to ask for
                    return done
        raise RuntimeError(f"engine {self.actor_id}: turn {key} cut by {MAX_CUTS_PER_TURN} weight updates in a row")

    def _ends_turn(self, token_id: int) -> bool:
        eos = self.vllm.eos_token_id
        return self.config.model.stop_at_eos and eos is not None and token_id == eos

    async def _finish(self, work: PrefillWork, key: str, prefill_engine_id: str, cached_tokens: int, gen: Generated) -> None:
        now_s = self.clock.now_s()
        self._event(EventKind.DECODE_DONE, work, generated_tokens=len(gen.token_ids), cached_prefix_tokens=cached_tokens)
        result = TurnResult(
            work_id=work.work_id,
            trajectory_id=work.trajectory_id,
            turn=work.turn,
            policy_version=max(work.policy_version, gen.policy_version),
            prefill_engine_id=prefill_engine_id,
            decode_engine_id=self.actor_id,
            output_tokens=len(gen.token_ids),
            cached_prefix_tokens=cached_tokens,
            token_ids=gen.token_ids,
            logprobs=gen.logprobs,
            finished_at_s=now_s,
            oldest_policy_version=gen.oldest_version,
        )
        await self._publish(subjects.result(work.env_id), encode(result), work.work_id)
        await self._ack(key)

    def _event(self, kind: EventKind, work: PrefillWork, **fields) -> None:
        fields.setdefault("cached_prefix_tokens", 0)
        self._work_event(
            kind,
            work,
            at_s=self.clock.now_s(),
            role=self.core.role.value,
            new_tokens=work.new_tokens,
            context_tokens=work.context_tokens,
            **fields,
        )

    # --- heartbeat ---------------------------------------------------------------------------
    def heartbeat(self) -> EngineStatus:
        """The scheduler core's status with vLLM's own figures: the requests running, the KV
        pool vLLM allocated and its share in use, the context its requests hold."""
        status = super().heartbeat()
        pool = self.vllm.kv_capacity_tokens
        usage = self.steps.kv_usage if self.steps is not None else 0.0
        return msgspec.structs.replace(
            status,
            waiting_prefill=self._running["prefill"],
            running_decode=self._running["decode"],
            kv_capacity_tokens=pool or status.kv_capacity_tokens,
            kv_used_tokens=round(usage * pool) if pool else status.kv_used_tokens,
            decode_context_tokens=self.vllm.decode_context_tokens(),
        )
