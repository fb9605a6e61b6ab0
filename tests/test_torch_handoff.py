"""The torch backend on the real bus: the KV hand-off between two engines is exact; bad KV
means a re-prefill; a model that differs from the trainer's is refused at start."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch", reason="the torch backend is the optional [torch] extra; the dev extra CI installs includes it")

from actors.config import ModelSection
from actors.engine.torch.actor import ModelMismatch, TorchEngineActor
from actors.engine.torch.model import build_tiny, kv_checksum, load_model
from actors.trainer.torch_trainer import TorchTrainerActor
from bus_schemas import streams, subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import Role
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.work import DecodeWork, KvChunk, KvFetch, KvHandle, PrefillWork, TurnResult
from ops.export import read_stream
from tests.torch_helpers import clock, prompt_ids, real_work, torch_config

pytestmark = pytest.mark.bus

# Decode logits on engine B (KV prefilled on engine A, moved over NATS, batched with other
# sequences under left padding) against one plain forward pass in this process, float32.
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny(ModelSection(seed=0), tmp_path_factory.mktemp("tiny") / "model")


async def events(bus) -> list[LifecycleEvent]:
    return await read_stream(bus.jetstream(), streams.LIFECYCLE, subjects.lifecycle_all(), LifecycleEvent)


class Results:
    """Turn results as they are stored (a core subscription on the result subject is the barrier)."""

    def __init__(self) -> None:
        self.got: dict[str, TurnResult] = {}
        self.changed = asyncio.Event()

    async def on_msg(self, msg) -> None:
        result = decode(TurnResult, msg.data)
        self.got[result.trajectory_id] = result
        self.changed.set()

    async def wait_for(self, n: int) -> None:
        while len(self.got) < n:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), timeout=60)


async def test_decode_on_b_from_kv_prefilled_on_a_matches_a_single_process_forward(bus, tmp_path, checkpoint):
    config = torch_config(tmp_path, checkpoint, kv_chunk_bytes=4096)  # small chunks: every transfer is multi-chunk
    results = Results()
    await bus.subscribe(subjects.result("env0"), cb=results.on_msg)
    a = TorchEngineActor("e0", config, bus, clock(), Role.PREFILL)
    b = TorchEngineActor("e1", config, bus, clock(), Role.DECODE)
    b.torch.record_logits = {}
    running = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
    js = bus.jetstream()
    prompts = {f"t{i}": prompt_ids(i, n) for i, n in enumerate((37, 12, 60))}  # different lengths: padded batch
    try:
        await asyncio.wait_for(asyncio.gather(a.ready.wait(), b.ready.wait()), timeout=30)
        for traj, ids in prompts.items():
            await js.publish(subjects.work_prefill(), encode(real_work(traj, ids, out=10)))
        await results.wait_for(3)
        turn0 = dict(results.got)
        # turn 1 of t0: the history, then a new observation; B already holds most of the history
        obs = prompt_ids(99, 9)
        history = prompts["t0"] + list(turn0["t0"].token_ids)
        # and t1 with a context B holds nothing of: A prepared its KV from the context's end, B
        # asks for all of it, so A serialises it at the fetch instead
        other_context, other_obs = prompt_ids(50, 20), prompt_ids(98, 5)
        results.got.clear()
        await js.publish(subjects.work_prefill(), encode(real_work("t0", obs, turn=1, context=history, out=6)))
        await js.publish(subjects.work_prefill(), encode(real_work("t1", other_obs, turn=1, context=other_context, out=6)))
        await results.wait_for(2)
        turn1, other1 = results.got["t0"], results.got["t1"]
    finally:
        a.request_stop("test over")
        b.request_stop("test over")
        await asyncio.wait_for(asyncio.gather(*running), timeout=20)

    reference = load_model(checkpoint)
    worst = 0.0
    for traj, ids in prompts.items():
        r = turn0[traj]
        assert (r.prefill_engine_id, r.decode_engine_id, r.output_tokens) == ("e0", "e1", 10)
        assert len(r.token_ids) == len(r.logprobs) == 10
        worst = max(worst, _check_logits(reference, ids, r, b.torch.record_logits[r.work_id]))
    worst = max(worst, _check_logits(reference, history + obs, turn1, b.torch.record_logits[turn1.work_id]))
    worst = max(worst, _check_logits(reference, other_context + other_obs, other1, b.torch.record_logits[other1.work_id]))
    assert worst < LOGITS_ATOL

    transfers = {(e.trajectory_id, e.turn): e for e in await events(bus) if e.kind is EventKind.KV_TRANSFER_DONE}
    per_token = a.torch.kv_bytes_per_token
    assert transfers[("t2", 0)].kv_bytes == 60 * per_token > 4096  # several chunks
    # turn 1 moves only what B lacks: the last generated token of turn 0 and the observation
    assert turn1.cached_prefix_tokens == len(prompts["t0"])  # A's prefix cache served the prompt
    assert transfers[("t0", 1)].kv_bytes == (1 + len(obs)) * per_token
    assert b.counters["kv_tokens_reused"] == len(history) - 1
    assert not a.core.held and not a._outgoing and b.counters["reprefills"] == 0
    assert transfers[("t1", 1)].kv_bytes == (len(other_context) + len(other_obs)) * per_token
    # turn 0 (from 0) and t0's turn 1 (from B's cached prefix) were serialised at hand-off, t1's turn 1 at the fetch
    assert (a.counters["kv_served_prepared"], a.counters["kv_served_serialised_at_fetch"]) == (4, 1)
    assert not a._prepared


def _check_logits(reference, prompt: list[int], result: TurnResult, recorded: list) -> float:
    """Decode step i of B produced token i (i >= 1) from the logits at position len(prompt)-1+i."""
    full = torch.tensor([prompt + list(result.token_ids)])
    with torch.inference_mode():
        logits = reference(full).logits[0]
    assert len(recorded) == len(result.token_ids) - 1
    start = len(prompt)
    diff = max((recorded[i - 1] - logits[start - 1 + i]).abs().max().item() for i in range(1, len(result.token_ids)))
    # the logprobs the engines report are those of the same distribution (temperature 1)
    logp = torch.log_softmax(logits[start - 1 : start - 1 + len(result.token_ids)], -1)
    expected = logp.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4)
    return diff


async def test_unknown_handle_and_checksum_mismatch_send_the_turn_back_to_prefill(bus, tmp_path, checkpoint):
    config = torch_config(tmp_path, checkpoint)
    js = bus.jetstream()
    ids = prompt_ids(1, 20)

    async def corrupt_holder(msg) -> None:  # a holder whose bytes do not match its checksum
        request = decode(KvFetch, msg.data)
        data = bytes(20 * b.torch.kv_bytes_per_token)
        await msg.respond(
            encode(
                KvChunk(
                    handle_id=request.handle_id, ok=True, tokens=20, kv_bytes=len(data), checksum=kv_checksum(b"other bytes"), data=data
                )
            )
        )

    await bus.subscribe(subjects.kv("e7"), cb=corrupt_holder)
    a = TorchEngineActor("e0", config, bus, clock(), Role.PREFILL)
    b = TorchEngineActor("e1", config, bus, clock(), Role.DECODE)
    unknown = real_work("lost", ids)
    corrupt = real_work("corrupt", ids)
    handle = dict(tokens=20, kv_bytes=1, expires_at_s=1e9)
    await js.publish(
        subjects.work_decode(),
        encode(DecodeWork(prefill=unknown, kv=KvHandle(engine_id="e0", handle_id="nope", **handle), first_token_id=65, prefilled_at_s=0.0)),
    )
    await js.publish(
        subjects.work_decode(),
        encode(DecodeWork(prefill=corrupt, kv=KvHandle(engine_id="e7", handle_id="h", **handle), first_token_id=65, prefilled_at_s=0.0)),
    )
    a._pulling = False  # A only serves kv.e0 (it knows no handle "nope"); re-prefilled turns stay queued
    a_running = asyncio.create_task(a.run())
    await asyncio.wait_for(a.ready.wait(), timeout=30)
    await asyncio.wait_for(b.run(burst=True), timeout=30)
    a.request_stop("test over")
    await asyncio.wait_for(a_running, timeout=20)

    assert b.counters["reprefills"] == 2 and b.counters["kv_checksum_mismatch"] == 1
    assert a.counters["kv_unknown_handle"] == 1
    requeued = await read_stream(js, streams.WORK_PREFILL, subjects.work_prefill(), PrefillWork)
    assert sorted((w.trajectory_id, w.attempt, w.token_ids == ids) for w in requeued) == [("corrupt", 1, True), ("lost", 1, True)]
    assert not b.core.running and not b.torch.states  # nothing decoded on wrong or missing KV
    details = {e.trajectory_id: e.detail for e in await events(bus) if e.kind is EventKind.REPREFILL}
    assert "checksum" in details["corrupt"] and "unknown or expired" in details["lost"]


async def test_kv_prepared_at_hand_off_goes_when_the_handle_expires_unfetched(bus, tmp_path, checkpoint):
    # vLLM's PD prefills before a decode engine asks; under sglang's gate the turn would wait
    # for one unstarted (tests/test_admission.py)
    config = torch_config(tmp_path, checkpoint, kv_ttl_s=0.5, admission="vllm")
    a = TorchEngineActor("e0", config, bus, clock(), Role.PREFILL)  # no decode engine fetches
    running = asyncio.create_task(a.run())
    try:
        await bus.jetstream().publish(subjects.work_prefill(), encode(real_work("t", prompt_ids(2, 30))))
        for _ in range(100):
            if a._prepared:
                break
            await asyncio.sleep(0.05)  # barrier-ok: polls a condition (the TTL passes in real time)
        assert list(a._prepared) == list(a.core.held)  # serialised and encoded at hand-off
        for _ in range(100):
            if a.counters["kv_expired"]:
                break
            await asyncio.sleep(0.05)  # barrier-ok: polls a condition (the TTL passes in real time)
    finally:
        a.request_stop("test over")
        await asyncio.wait_for(running, timeout=20)
    assert a.counters["kv_expired"] == 1 and not a._prepared and not a.core.held and not a.torch.states


async def test_malformed_token_ids_are_rejected_and_counted(bus, tmp_path, checkpoint):
    config = torch_config(tmp_path, checkpoint, policy="colocated")
    js = bus.jetstream()
    bad = real_work("bad", [1, 2, 3])
    bad = PrefillWork(**{**{f: getattr(bad, f) for f in bad.__struct_fields__}, "new_tokens": 5})  # counts disagree
    out_of_vocab = real_work("oov", [1, 2, 100_000])
    await js.publish(subjects.work_prefill(), encode(bad))
    await js.publish(subjects.work_prefill(), encode(out_of_vocab))
    await js.publish(subjects.work_prefill(), encode(real_work("good", prompt_ids(3, 8), out=4)))
    e0 = TorchEngineActor("e0", config, bus, clock(), Role.COLOCATED)
    await asyncio.wait_for(e0.run(burst=True), timeout=30)
    assert e0.counters["invalid_messages"] == 2
    [result] = await read_stream(js, streams.RESULTS, subjects.result_all(), TurnResult)
    assert result.trajectory_id == "good" and len(result.token_ids) == 4


async def test_an_engine_whose_model_differs_from_the_trainers_refuses_to_start(bus, tmp_path, checkpoint):
    other = build_tiny(ModelSection(seed=0, hidden_size=32, intermediate_size=64), tmp_path / "other")
    trainer = TorchTrainerActor("trainer", torch_config(tmp_path, other, hidden=32), bus, clock())
    await trainer.setup()  # serves its model spec
    engine = TorchEngineActor("e0", torch_config(tmp_path, checkpoint, verify=True), bus, clock(), Role.COLOCATED)
    with pytest.raises(ModelMismatch) as refused:
        await asyncio.wait_for(engine.run(), timeout=30)
    message = str(refused.value)
    assert "refuses to start" in message and "hidden_size: engine 64, trainer 32" in message
    assert "intermediate_size: engine 128, trainer 64" in message
    assert not engine.ready.is_set()  # it never served anything
