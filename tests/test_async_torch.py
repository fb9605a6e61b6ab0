"""Async RL on the torch backend, on the real bus: the version recorded on each turn
matches the weights that produced it. A prefill and a decode engine take version 1 from the
trainer's weight service (`train.weights`) while turns of version 0 are mid-rollout; every
turn's logprobs are checked against one plain forward pass of the version it reports."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

torch = pytest.importorskip("torch", reason="the torch backend is the optional [torch] extra; the dev extra CI installs includes it")

from actors.config import ModelSection
from actors.engine.torch.actor import TorchEngineActor
from actors.engine.torch.model import ByteTokenizer, build_tiny, checksum, load_model, split_chunks, weights_to_bytes
from actors.trainer.torch_trainer import TorchTrainerActor
from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import CommandAck, LoadPolicy, Role
from tests.actor_helpers import TurnWatch
from tests.torch_helpers import clock, prompt_ids, real_work, torch_config

pytestmark = pytest.mark.bus

LOGPROB_ATOL = 1e-4  # float32, batched and padded on the engines against one unpadded forward here
TURNS = 6  # per wave: one before the update, one after
OUT = 48  # tokens per turn: decodes are still running when the update comes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny(ModelSection(seed=0), tmp_path_factory.mktemp("tiny") / "model")


def version_one(checkpoint):
    """Version 1: version 0 moved far enough that every turn's logprobs tell them apart."""
    lm = load_model(checkpoint)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return lm


def forward_logprobs(lm, prompt: list[int], generated: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + generated])
    with torch.inference_mode():
        logp = torch.log_softmax(lm(ids).logits[0].float(), -1)  # temperature 1
    rows = logp[len(prompt) - 1 : len(prompt) - 1 + len(generated)]
    return rows.gather(1, torch.tensor(generated)[:, None])[:, 0]


def async_config(tmp_path, checkpoint, inflight_on_update: str | None = None):
    """The torch test config in async mode (and the given inflight_on_update)."""
    config = torch_config(tmp_path, checkpoint, kv_chunk_bytes=64 * 1024)
    config = msgspec.structs.replace(config, run=msgspec.structs.replace(config.run, mode="async"))
    if inflight_on_update is None:
        return config
    return msgspec.structs.replace(config, engines=msgspec.structs.replace(config.engines, inflight_on_update=inflight_on_update))


async def serve_version_one(bus, config, lm) -> None:
    """The trainer's weight service (`train.weights`), serving `lm` as version 1 as it does after training it."""
    trainer = TorchTrainerActor("trainer", config, bus, clock(), lm=lm, tokenizer=ByteTokenizer())
    payload = weights_to_bytes(lm)
    trainer._weights[1] = (split_chunks(payload, config.model.kv_chunk_bytes), checksum(payload), len(payload))
    await bus.subscribe(subjects.train_weights(), cb=trainer._on_weights_fetch)


def engine_pair(config, bus, checkpoint) -> tuple[TorchEngineActor, TorchEngineActor]:
    """A prefill engine e0 and a decode engine e1, both on version 0."""
    return tuple(
        TorchEngineActor(e, config, bus, clock(), role, lm=load_model(checkpoint), tokenizer=ByteTokenizer())
        for e, role in (("e0", Role.PREFILL), ("e1", Role.DECODE))
    )


async def load_version_one(bus) -> list:
    """Ask both engines to take version 1; their replies."""
    return list(
        await asyncio.gather(*(bus.request(subjects.ctl_policy(e), encode(LoadPolicy(version=1)), timeout=30) for e in ("e0", "e1")))
    )


async def stop(engines, runs) -> None:
    for engine in engines:
        engine.request_stop("test over")
    await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), timeout=30)


async def test_every_turn_reports_the_version_whose_weights_produced_it(bus, tmp_path, checkpoint):
    config = async_config(tmp_path, checkpoint)
    models = {0: load_model(checkpoint), 1: version_one(checkpoint)}
    await serve_version_one(bus, config, models[1])

    watch = TurnWatch(2 * TURNS, decoding_on="e1")
    await watch.subscribe(bus, subjects.result("env0"))
    got, all_in, decoding = watch.got, watch.all_in, watch.decoding
    prefill, decode_ = engine_pair(config, bus, checkpoint)
    runs = [asyncio.create_task(prefill.run()), asyncio.create_task(decode_.run())]
    prompts = {f"old{i}": prompt_ids(i, 20 + 7 * i) for i in range(TURNS)} | {
        f"new{i}": prompt_ids(100 + i, 15 + 5 * i) for i in range(TURNS)
    }
    js = bus.jetstream()
    try:
        await asyncio.wait_for(asyncio.gather(prefill.ready.wait(), decode_.ready.wait()), timeout=30)
        for i in range(TURNS):
            await js.publish(subjects.work_prefill(), encode(real_work(f"old{i}", prompts[f"old{i}"], out=OUT)))
        await asyncio.wait_for(decoding.wait(), timeout=30)
        acks = await load_version_one(bus)
        assert all(decode(CommandAck, a.data).ok and decode(CommandAck, a.data).policy_version == 1 for a in acks)
        for i in range(TURNS):  # assigned at version 0 (a trajectory started before the update): run on 1
            await js.publish(subjects.work_prefill(), encode(real_work(f"new{i}", prompts[f"new{i}"], out=OUT)))
        await asyncio.wait_for(all_in.wait(), timeout=60)
    finally:
        await stop((prefill, decode_), runs)

    assert sorted(got) == sorted(prompts)
    versions = {t: r.policy_version for t, r in got.items()}
    assert {versions[f"new{i}"] for i in range(TURNS)} == {1}
    assert 0 in versions.values()  # some turns were in flight on version 0 and finished there
    for traj, r in got.items():
        assert len(r.token_ids) == len(r.logprobs) == OUT, traj
        assert r.oldest_policy_version in (-1, r.policy_version), traj  # finish: no turn spans two versions
        expected = {v: forward_logprobs(lm, prompts[traj], list(r.token_ids)) for v, lm in models.items()}
        reported = torch.tensor(r.logprobs)
        gap = {v: (reported - e).abs().max().item() for v, e in expected.items()}
        assert gap[r.policy_version] < LOGPROB_ATOL, (traj, r.policy_version, gap)
        assert gap[1 - r.policy_version] > 100 * LOGPROB_ATOL, (traj, gap)  # the other version's would not pass


async def test_an_interrupting_update_resumes_each_cut_turn_on_the_new_weights_with_its_tokens(bus, tmp_path, checkpoint):
    """engines.inflight_on_update = "interrupt": turns decoding when version 1 lands are cut,
    recomputed under version 1 with their tokens so far, and decode on. Each token's logprob
    is that of the weights it was sampled under: a prefix of version 0's, the rest version 1's."""
    config = async_config(tmp_path, checkpoint, inflight_on_update="interrupt")
    models = {0: load_model(checkpoint), 1: version_one(checkpoint)}
    await serve_version_one(bus, config, models[1])

    watch = TurnWatch(TURNS, decoding_on="e1")
    await watch.subscribe(bus, subjects.result("env0"))
    prefill, decode_ = engine_pair(config, bus, checkpoint)
    runs = [asyncio.create_task(prefill.run()), asyncio.create_task(decode_.run())]
    prompts = {f"cut{i}": prompt_ids(200 + i, 20 + 7 * i) for i in range(TURNS)}
    js = bus.jetstream()
    try:
        await asyncio.wait_for(asyncio.gather(prefill.ready.wait(), decode_.ready.wait()), timeout=30)
        for traj, prompt in prompts.items():
            await js.publish(subjects.work_prefill(), encode(real_work(traj, prompt, out=4 * OUT)))
        await asyncio.wait_for(watch.decoding.wait(), timeout=30)
        acks = await load_version_one(bus)
        assert all(decode(CommandAck, a.data).ok for a in acks)
        await asyncio.wait_for(watch.all_in.wait(), timeout=120)
    finally:
        await stop((prefill, decode_), runs)

    assert decode_.counters["turns_interrupted"] > 0
    cut = 0
    for traj, r in watch.got.items():
        assert len(r.token_ids) == len(r.logprobs) == 4 * OUT, traj  # no token lost to the cut
        reported = torch.tensor(r.logprobs)
        matches = {v: (reported - forward_logprobs(lm, prompts[traj], list(r.token_ids))).abs() < LOGPROB_ATOL for v, lm in models.items()}
        if r.oldest_policy_version == 0 and r.policy_version == 1:  # cut mid-decode: version 0's tokens, then 1's
            k = int(matches[1].long().argmax())  # the first token sampled under version 1
            assert 0 < k and bool(matches[0][:k].all()) and bool(matches[1][k:].all()), (traj, k, matches)
            cut += 1
        else:  # finished before the update, or started after it
            assert bool(matches[r.policy_version].all()), (traj, r.policy_version, r.oldest_policy_version)
    assert cut > 0


async def test_kv_that_lands_after_an_interrupting_update_began_is_prefilled_again_on_the_new_weights(bus, tmp_path, checkpoint):
    """The race the interrupt cannot cut: a turn whose KV (version 0) is on the wire when the
    update runs is admitted only after it, so no cut reaches it. The decode engine must refuse
    that KV and send the turn back to prefill; admitted, it would decode on version 1's weights
    over version 0's KV and report version 0. The update is made to land inside the real KV
    fetch by running it from a wrapper around the decode engine's fetch."""
    config = async_config(tmp_path, checkpoint, inflight_on_update="interrupt")
    models = {0: load_model(checkpoint), 1: version_one(checkpoint)}
    await serve_version_one(bus, config, models[1])

    watch = TurnWatch(1, decoding_on="e1")
    await watch.subscribe(bus, subjects.result("env0"))
    prefill, decode_ = engine_pair(config, bus, checkpoint)
    fetch, acks = decode_._fetch_kv, []

    async def fetch_then_update(*args):
        got = await fetch(*args)
        if not acks:  # the first hand-off only: version 1 lands on both engines before it is admitted
            acks.extend(await load_version_one(bus))
        return got

    decode_._fetch_kv = fetch_then_update
    runs = [asyncio.create_task(prefill.run()), asyncio.create_task(decode_.run())]
    prompt = prompt_ids(300, 33)
    try:
        await asyncio.wait_for(asyncio.gather(prefill.ready.wait(), decode_.ready.wait()), timeout=30)
        await bus.jetstream().publish(subjects.work_prefill(), encode(real_work("late", prompt, out=OUT)))
        await asyncio.wait_for(watch.all_in.wait(), timeout=60)
    finally:
        await stop((prefill, decode_), runs)

    assert len(acks) == 2 and all(decode(CommandAck, a.data).ok for a in acks)
    assert decode_.counters["kv_stale_version"] == 1
    r = watch.got["late"]
    assert r.policy_version == 1 and len(r.token_ids) == len(r.logprobs) == OUT
    expected = forward_logprobs(models[1], prompt, list(r.token_ids))
    assert (torch.tensor(r.logprobs) - expected).abs().max().item() < LOGPROB_ATOL  # every token, the first included, of version 1
