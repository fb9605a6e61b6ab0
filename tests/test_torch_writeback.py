"""KV write-back on the torch backend (`engines.kv_writeback = "to-prefill"`), on the real bus:
the decode engine's output KV goes back to the prefill engine over NATS (chunked, CRC-32C
checked); the next turn's prefill computes only the tokens that have no KV anywhere, and its
logits and KV match one forward pass of the whole sequence in this process."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

torch = pytest.importorskip("torch", reason="the torch backend is the optional [torch] extra; the dev extra CI installs includes it")

from actors.config import ModelSection
from actors.engine.torch.actor import TorchEngineActor
from actors.engine.torch.model import build_tiny, kv_checksum, load_model
from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import Role
from bus_schemas.lifecycle import EventKind
from bus_schemas.work import KvChunk, KvFetch, KvHandle, KvWriteback, KvWritebackAck
from tests.test_torch_handoff import LOGITS_ATOL, _check_logits
from tests.test_writeback import Watch
from tests.torch_helpers import clock, prompt_ids, real_work, torch_config

pytestmark = pytest.mark.bus

KV_ATOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny(ModelSection(seed=0), tmp_path_factory.mktemp("tiny") / "model")


def writeback_config(tmp_path, checkpoint, mode: str = "to-prefill"):
    config = torch_config(tmp_path, checkpoint, kv_chunk_bytes=4096)  # small chunks: multi-chunk transfers
    return msgspec.structs.replace(config, engines=msgspec.structs.replace(config.engines, kv_writeback=mode))


async def test_the_next_prefill_computes_only_the_new_tokens_and_matches_one_forward(bus, tmp_path, checkpoint):
    config = writeback_config(tmp_path, checkpoint)
    watch = Watch()
    await watch.start(bus, EventKind.PREFILL_DONE, EventKind.KV_WRITEBACK_DONE)
    a = TorchEngineActor("e0", config, bus, clock(), Role.PREFILL)
    b = TorchEngineActor("e1", config, bus, clock(), Role.DECODE)
    a.torch.record_logits, b.torch.record_logits = {}, {}
    running = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
    js = bus.jetstream()
    prompt, obs = prompt_ids(7, 37), prompt_ids(97, 9)
    try:
        await asyncio.wait_for(asyncio.gather(a.ready.wait(), b.ready.wait()), timeout=30)
        await js.publish(subjects.work_prefill(), encode(real_work("t0", prompt, out=10)))
        await watch.until(lambda: len(watch.results) == 1 and watch.of(EventKind.KV_WRITEBACK_DONE, "t0", 0), timeout=60)
        turn0 = watch.results[0]
        history = prompt + list(turn0.token_ids)
        landed_ids, landed_kv = a.torch.cache.entry("t0", 0)  # what the write-back left in A's cache
        landed_ids, landed_kv = list(landed_ids), [(k.clone(), v.clone()) for k, v in landed_kv]
        prefilled_before = a.prefilled_tokens_total
        await js.publish(subjects.work_prefill(), encode(real_work("t0", obs, turn=1, context=history, out=6)))
        await watch.until(lambda: len(watch.results) == 2, timeout=60)
        turn1 = watch.results[1]
    finally:
        a.request_stop("test over")
        b.request_stop("test over")
        await asyncio.wait_for(asyncio.gather(*running), timeout=20)

    per_token = a.torch.kv_bytes_per_token
    [written] = watch.of(EventKind.KV_WRITEBACK_DONE, "t0", 0)
    # A held the 37-token prompt; the 10 generated tokens less the last (no KV yet) came back
    assert (written.engine_id, written.cached_prefix_tokens, written.new_tokens) == ("e0", len(history) - 1, 9)
    assert written.kv_bytes == 9 * per_token > 4096 and written.duration_s > 0  # several checksummed chunks
    assert landed_ids == history[:-1]
    # the next turn's prefill computed the last sampled token and the observation, nothing else
    [prefill1] = watch.of(EventKind.PREFILL_DONE, "t0", 1)
    assert prefill1.cached_prefix_tokens == turn1.cached_prefix_tokens == len(history) - 1
    assert a.prefilled_tokens_total - prefilled_before == 1 + len(obs)
    assert a.counters["kv_writeback_landed"] >= 1 and a.counters["kv_writeback_failed"] == 0
    assert b.counters["reprefills"] == 0 and a.counters["kv_checksum_mismatch"] == 0
    # the decode engine counts the tokens its decodes generated (the first of each turn was
    # sampled at the end of the prefill, on A): the allocator's prefill-per-decode-token reading
    assert b.decoded_tokens_total == len(turn0.token_ids) - 1 + len(turn1.token_ids) - 1 == 9 + 5
    assert a.decoded_tokens_total == 0

    reference = load_model(checkpoint)
    with torch.inference_mode():
        out = reference(torch.tensor([history[:-1]]), use_cache=True)
        ref_kv = [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]
        full_logits = reference(torch.tensor([history + obs])).logits[0]
    # the written-back KV (A's prompt KV + B's decode KV, moved over NATS) is one forward's KV
    kv_diff = max(max((k - rk).abs().max().item(), (v - rv).abs().max().item()) for (k, v), (rk, rv) in zip(landed_kv, ref_kv))
    assert kv_diff < KV_ATOL
    # A's first-token logits for turn 1, computed on that KV, are the single forward's
    first = a.torch.record_logits[turn1.work_id][0]
    assert (first - full_logits[len(history) + len(obs) - 1]).abs().max().item() < LOGITS_ATOL
    # and B's decode of turn 1 (its own cached prefix + what A sent) matches too
    assert _check_logits(reference, history + obs, turn1, b.torch.record_logits[turn1.work_id]) < LOGITS_ATOL


async def test_a_corrupt_write_back_is_counted_and_never_lands(bus, tmp_path, checkpoint):
    """A holder whose bytes fail their checksum: the prefill engine counts the failure and keeps
    its own prefix; the next turn would compute what it lacks."""
    config = writeback_config(tmp_path, checkpoint)
    a = TorchEngineActor("e0", config, bus, clock(), Role.PREFILL)
    a._pulling = False
    ids = prompt_ids(3, 12)
    a.torch.cache.put("c", 0, ids[:8], [(torch.zeros(a.torch.kv_heads, 8, a.torch.head_dim),) * 2] * a.torch.layers)
    served = asyncio.Event()

    async def corrupt_holder(msg) -> None:
        request = decode(KvFetch, msg.data)
        data = bytes((12 - request.have_tokens) * a.torch.kv_bytes_per_token)
        await msg.respond(
            encode(
                KvChunk(
                    handle_id=request.handle_id,
                    ok=True,
                    tokens=12 - request.have_tokens,
                    kv_bytes=len(data),
                    start_tokens=request.have_tokens,
                    checksum=kv_checksum(b"other"),
                    data=data,
                )
            )
        )
        served.set()

    await bus.subscribe(subjects.kv("stub"), cb=corrupt_holder)
    running = asyncio.create_task(a.run())
    try:
        await asyncio.wait_for(a.ready.wait(), timeout=30)
        handle = KvHandle(engine_id="stub", handle_id="c/wb", tokens=12, kv_bytes=4, expires_at_s=1e9)
        notice = KvWriteback(trajectory_id="c", turn=0, policy_version=0, kv=handle, prefix_tokens=8, token_ids=ids)
        ack = decode(KvWritebackAck, (await bus.request(subjects.kv_writeback("e0"), encode(notice), timeout=5)).data)
        assert ack.ok
        await asyncio.wait_for(served.wait(), timeout=10)
        for _ in range(200):
            if a.counters["kv_writeback_failed"]:
                break
            await asyncio.sleep(0.01)  # barrier-ok: polls a counter set right after the reply is checked
    finally:
        a.request_stop("test over")
        await asyncio.wait_for(running, timeout=20)
    assert a.counters["kv_writeback_failed"] == 1 and a.counters["kv_checksum_mismatch"] == 1
    assert a.torch.cache.peek("c", 0) == ids[:8]  # its own prefix, untouched


async def test_the_store_tier_is_refused_by_name_on_the_torch_backend(bus, tmp_path, checkpoint):
    with pytest.raises(ValueError, match="emulated backend only"):
        TorchEngineActor("e0", writeback_config(tmp_path, checkpoint, "store"), bus, clock(), Role.PREFILL)
