"""The NATS side of Prorsa's vLLM KV connector: held KV, its server, and the fetch.

vLLM runs the connector inside its engine-core process, in synchronous code; this module
gives it the bus on a daemon thread with its own event loop and its own connection:

    holder (prefill)                                   loader (decode)
    hold(handle, payload, tokens) ── subjects.kv(me) ◀── fetch(holder, handle, have_tokens)
       KvChunk replies (checksummed, chunked)       ──▶  payload checked (CRC-32C), returned

A payload is the KV of whole blocks, layer after layer: what the holder copied out of its
paged KV cache, as bytes. `have_tokens` (block-aligned) says which blocks the loader already
holds; only the blocks from there move. Held KV expires after its TTL (wall seconds, on the
bus thread's loop: vLLM runs in wall time, not in Prorsa's model time).

Counters (`stats()`) are served on `subjects.kv_connector_stats(engine_id)` so tests and
benches can read them from outside vLLM's process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import nats
from nats.aio.msg import Msg

from actors.base.connection import connect
from actors.engine.torch.model import kv_checksum, kv_checksum_matches, split_chunks
from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.work import KvChunk, KvFetch

log = logging.getLogger("prorsa.vllm.kvbus")

_kv_fetch = msgspec.msgpack.Decoder(KvFetch)
_kv_chunk = msgspec.msgpack.Decoder(KvChunk)


class KvLoadError(RuntimeError):
    """The KV behind a handle could not be loaded (unknown, expired, unreachable, corrupt)."""


@dataclass(slots=True)
class Held:
    payload: bytes  # whole blocks, layer-major (see module docstring)
    tokens: int  # KV positions 0..tokens the payload covers
    block_bytes: int  # bytes of one block of one layer
    layers: int
    block_size_tokens: int
    expires_at_s: float  # on the bus thread's loop clock
    sent: dict[int, tuple[bytes | memoryview, str]] = field(default_factory=dict)  # first block -> (data, checksum)


class KvBus:
    """A NATS connection on its own thread; every public method is safe to call from vLLM's."""

    def __init__(self, nats_url: str, engine_id: str, chunk_bytes: int, ttl_wall_s: float, timeout_wall_s: float) -> None:
        self.engine_id = engine_id
        self.chunk_bytes = chunk_bytes
        self.ttl_wall_s = ttl_wall_s
        self.timeout_wall_s = timeout_wall_s
        self.counters: Counter[str] = Counter()
        self._held: dict[str, Held] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"kvbus-{engine_id}", daemon=True)
        self._thread.start()
        self._nc = self._run(self._connect(nats_url), timeout_wall_s)

    # --- thread plumbing ------------------------------------------------------------------
    def _run(self, coro, timeout_wall_s: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_wall_s)

    async def _connect(self, url: str):
        # the actors' connection: reconnects, and the engine's bus credentials from the
        # environment vLLM's processes inherit (ops/access.py: engines may serve their KV subjects)
        nc = await connect(url, f"vllm-kv-{self.engine_id}", log)
        await nc.subscribe(subjects.kv(self.engine_id), cb=self._on_fetch)
        await nc.subscribe(subjects.kv_connector_stats(self.engine_id), cb=self._on_stats)
        await nc.flush()
        return nc

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self._run(self._nc.drain(), self.timeout_wall_s)
            except (TimeoutError, nats.errors.Error) as err:
                log.warning("kv bus of %s: closing: %s", self.engine_id, err)
            self._loop.call_soon_threadsafe(self._loop.stop)

    # --- the holder ---------------------------------------------------------------------
    def hold(self, handle_id: str, held: Held) -> None:
        held.expires_at_s = self._loop.time() + self.ttl_wall_s
        with self._lock:
            self._held[handle_id] = held
        self.counters["kv_held"] += 1

    def held_handles(self) -> int:
        with self._lock:
            return len(self._held)

    def _take(self, handle_id: str) -> Held | None:
        now_s = self._loop.time()
        with self._lock:
            for key in [k for k, h in self._held.items() if h.expires_at_s < now_s]:
                del self._held[key]
                self.counters["kv_expired"] += 1
            return self._held.get(handle_id)

    async def _on_fetch(self, msg: Msg) -> None:
        try:
            req = _kv_fetch.decode(msg.data)
        except msgspec.DecodeError as err:
            self.counters["invalid_messages"] += 1
            log.error("kv bus of %s: undecodable KvFetch: %s", self.engine_id, err)
            return
        await msg.respond(encode(self._reply(req)))

    def _reply(self, req: KvFetch) -> KvChunk:
        held = self._take(req.handle_id)
        if held is None:
            self.counters["kv_unknown_handle"] += 1
            return KvChunk(handle_id=req.handle_id, ok=False, error=f"unknown or expired KV handle {req.handle_id!r} on {self.engine_id}")
        first_block = min(req.have_tokens, held.tokens) // held.block_size_tokens
        data, digest = self._slice(held, first_block)
        chunks = split_chunks(data, self.chunk_bytes)
        if req.chunk >= len(chunks):
            self.counters["invalid_messages"] += 1
            return KvChunk(handle_id=req.handle_id, ok=False, error=f"chunk {req.chunk} out of range ({len(chunks)} chunks)")
        self.counters["kv_chunks_served"] += 1
        self.counters["kv_bytes_served"] += len(chunks[req.chunk])
        return KvChunk(
            handle_id=req.handle_id,
            ok=True,
            chunk=req.chunk,
            n_chunks=len(chunks),
            tokens=held.tokens,
            kv_bytes=len(data),
            checksum=digest if req.chunk == 0 else "",
            data=bytes(chunks[req.chunk]),
            start_tokens=first_block * held.block_size_tokens,
        )

    @staticmethod
    def _slice(held: Held, first_block: int) -> tuple[bytes | memoryview, str]:
        """Every layer's blocks from `first_block` on, and their checksum (once per start)."""
        if first_block not in held.sent:
            n_blocks = len(held.payload) // (held.block_bytes * held.layers)
            layer_bytes = n_blocks * held.block_bytes
            skip = first_block * held.block_bytes
            view = memoryview(held.payload)
            data = b"".join(view[layer * layer_bytes + skip : (layer + 1) * layer_bytes] for layer in range(held.layers)) if skip else view
            held.sent[first_block] = (data, kv_checksum(data))
        return held.sent[first_block]

    async def _on_stats(self, msg: Msg) -> None:
        await msg.respond(msgspec.json.encode({**self.counters, "held_handles": self.held_handles()}))

    # --- the loader ---------------------------------------------------------------------
    def fetch(self, holder_id: str, handle_id: str, have_tokens: int) -> tuple[bytes, int]:
        """The payload behind `handle_id` from the block holding `have_tokens` on, and the
        first token position it covers. Raises KvLoadError."""
        try:
            return self._run(self._fetch(holder_id, handle_id, have_tokens), 2 * self.timeout_wall_s)
        except TimeoutError:
            raise KvLoadError(f"KV fetch of {handle_id!r} from {holder_id} timed out") from None

    async def _fetch(self, holder_id: str, handle_id: str, have_tokens: int) -> tuple[bytes, int]:
        started_s = self._loop.time()  # wall time: vLLM's process has no Prorsa clock
        first = await self._request(holder_id, KvFetch(handle_id=handle_id, requester_id=self.engine_id, have_tokens=have_tokens))
        rest = await asyncio.gather(
            *(
                self._request(holder_id, KvFetch(handle_id=handle_id, chunk=i, requester_id=self.engine_id, have_tokens=have_tokens))
                for i in range(1, first.n_chunks)
            )
        )
        parts = [first.data, *(c.data for c in rest)]
        if sum(len(p) for p in parts) != first.kv_bytes or not kv_checksum_matches(parts, first.checksum):
            self.counters["kv_checksum_failures"] += 1
            raise KvLoadError(f"KV of {handle_id!r} from {holder_id} is short or fails its checksum")
        data = b"".join(parts)
        self.counters["kv_fetched"] += 1
        self.counters["kv_bytes_fetched"] += first.kv_bytes
        self.counters["kv_fetch_us"] += round((self._loop.time() - started_s) * 1e6)  # request to checked payload
        return data, first.start_tokens

    async def _request(self, holder_id: str, req: KvFetch) -> KvChunk:
        try:
            msg = await self._nc.request(subjects.kv(holder_id), encode(req), timeout=self.timeout_wall_s)
        except (TimeoutError, nats.errors.Error) as err:
            raise KvLoadError(f"KV holder {holder_id} did not answer for {req.handle_id!r}: {type(err).__name__}") from None
        reply = _kv_chunk.decode(msg.data)
        if not reply.ok:
            raise KvLoadError(reply.error)
        return reply
