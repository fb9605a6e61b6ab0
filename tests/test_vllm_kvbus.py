"""The vLLM connector's bus side on the real nats-server, without vLLM: held KV is served in
checksummed chunks, only the blocks a loader lacks move, and a missing or expired handle is
an error the connector turns into a recompute (never wrong KV)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

pytest.importorskip("torch", reason="the KV checksum helpers live in the torch backend; the dev extra CI installs includes torch")

from actors.engine.vllm.kvbus import Held, KvBus, KvLoadError
from bus_schemas import subjects

pytestmark = pytest.mark.bus

LAYERS, BLOCKS, BLOCK_BYTES, BLOCK_TOKENS = 2, 3, 1000, 16


def payload() -> bytes:
    """Layer-major blocks, each block's bytes telling its layer and index."""
    return b"".join(bytes([10 * layer + block]) * BLOCK_BYTES for layer in range(LAYERS) for block in range(BLOCKS))


def held() -> Held:
    return Held(
        payload(),
        tokens=BLOCKS * BLOCK_TOKENS - 5,
        block_bytes=BLOCK_BYTES,
        layers=LAYERS,
        block_size_tokens=BLOCK_TOKENS,
        expires_at_s=0.0,
    )


@pytest.fixture
def buses(nats_server):
    holder = KvBus(nats_server.url, "kvh", chunk_bytes=1024, ttl_wall_s=60.0, timeout_wall_s=5.0)
    loader = KvBus(nats_server.url, "kvl", chunk_bytes=1024, ttl_wall_s=60.0, timeout_wall_s=5.0)
    yield holder, loader
    holder.close()
    loader.close()


async def test_whole_payload_in_checksummed_chunks(buses):
    holder, loader = buses
    holder.hold("h1", held())
    data, start = await asyncio.to_thread(loader.fetch, "kvh", "h1", 0)
    assert (data, start) == (payload(), 0)
    assert holder.counters["kv_chunks_served"] == 6  # 6000 bytes in 1024-byte chunks
    assert loader.counters["kv_fetched"] == 1 and loader.counters["kv_bytes_fetched"] == 6000


@pytest.mark.parametrize(("have_tokens", "first_block"), [(16, 1), (20, 1), (32, 2)])
async def test_only_the_blocks_the_loader_lacks_move(buses, have_tokens, first_block):
    holder, loader = buses
    holder.hold("h2", held())
    data, start = await asyncio.to_thread(loader.fetch, "kvh", "h2", have_tokens)
    assert start == first_block * BLOCK_TOKENS  # aligned down to the block that holds position have_tokens
    expected = b"".join(bytes([10 * layer + block]) * BLOCK_BYTES for layer in range(LAYERS) for block in range(first_block, BLOCKS))
    assert data == expected


async def test_unknown_and_expired_handles_are_errors(nats_server, buses):
    holder, loader = buses
    with pytest.raises(KvLoadError, match="unknown or expired KV handle 'nope' on kvh"):
        await asyncio.to_thread(loader.fetch, "kvh", "nope", 0)
    brief = KvBus(nats_server.url, "kvb", chunk_bytes=1024, ttl_wall_s=1e-9, timeout_wall_s=5.0)
    try:
        brief.hold("h3", held())
        with pytest.raises(KvLoadError, match="unknown or expired"):
            await asyncio.to_thread(loader.fetch, "kvb", "h3", 0)
        assert brief.counters["kv_expired"] == 1 and brief.held_handles() == 0
    finally:
        brief.close()
    with pytest.raises(KvLoadError, match="did not answer"):
        await asyncio.to_thread(loader.fetch, "no-such-engine", "h1", 0)


async def test_counters_are_served_on_the_stats_subject(bus, buses):
    holder, loader = buses
    holder.hold("h4", held())
    await asyncio.to_thread(loader.fetch, "kvh", "h4", 0)
    reply = await bus.request(subjects.kv_connector_stats("kvh"), b"", timeout=5)
    stats = msgspec.json.decode(reply.data)
    assert stats["kv_held"] == 1 and stats["held_handles"] == 1 and stats["kv_bytes_served"] == 6000
