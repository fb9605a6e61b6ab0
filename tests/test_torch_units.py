"""The torch backend's pure parts: GRPO, the prefix cache, model specs, weights on the wire."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch backend is the optional [torch] extra; the dev extra CI installs includes it")

from actors.config import ModelSection
from actors.engine.core import Batch, Seq
from actors.engine.torch.actor import KvChunkView
from actors.engine.torch.backend import TorchBackend
from actors.engine.torch.kv import DECODE_KV_SPARE_TOKENS, KvBufferLayer, KvError, PrefixCache
from actors.engine.torch.model import (
    ByteTokenizer,
    build_tiny,
    kv_checksum,
    kv_checksum_matches,
    load_model,
    load_weights_bytes,
    model_spec,
    spec_differences,
    tune_allocator,
    weights_to_bytes,
)
from actors.environment.envs.calc import CalcTask
from actors.trainer.grpo import group_advantages, grpo_update, token_logprobs
from bus_schemas.codec import decode, encode
from bus_schemas.train import FinishedTrajectory
from bus_schemas.work import KvChunk
from tests.torch_helpers import prompt_ids, real_work


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny(ModelSection(seed=0), tmp_path_factory.mktemp("tiny") / "model")


def finished(task: str, i: int, ids: list[int], mask: list[int], logprobs: list[float], reward: float) -> FinishedTrajectory:
    return FinishedTrajectory(
        trajectory_id=f"{task}-{i}",
        task_id=task,
        task_family="calc",
        env_id="env0",
        step=0,
        policy_versions=[0],
        turns=1,
        reward=reward,
        prompt_tokens=mask.index(1),
        generated_tokens=sum(mask),
        observation_tokens=0,
        started_at_s=0.0,
        finished_at_s=1.0,
        token_ids=ids,
        generated_mask=mask,
        logprobs=logprobs,
    )


def test_group_advantages_are_relative_to_the_group():
    adv = group_advantages([1.0, 0.0, 0.5, 0.5], ["a", "a", "b", "b"])
    assert adv[0] == pytest.approx(1.0, abs=1e-4) and adv[1] == pytest.approx(-1.0, abs=1e-4)
    assert adv[2:] == [0.0, 0.0]  # no spread in the group: no signal


def test_a_grpo_update_raises_the_probability_of_rewarded_tokens(checkpoint):
    lm = load_model(checkpoint)
    tok = ByteTokenizer()
    prompt = tok.encode("calc 1 2:")
    good, bad = tok.encode("7777"), tok.encode("abcd")

    def logprobs(seq: list[int]) -> list[float]:
        ids = torch.tensor([prompt + seq])
        with torch.no_grad():
            lp = token_logprobs(lm, ids, torch.ones_like(ids), 1.0)[0]
        return [0.0] * len(prompt) + lp[len(prompt) - 1 :].tolist()

    def seq_logprob(seq: list[int]) -> float:
        return sum(logprobs(seq))

    before_good, before_bad = seq_logprob(good), seq_logprob(bad)
    mask = [0] * len(prompt) + [1] * 4
    batch = [finished("k0", 0, prompt + good, mask, logprobs(good), 1.0), finished("k0", 1, prompt + bad, mask, logprobs(bad), 0.0)]
    # plain gradient steps: the objective sum_i A_i log p(seq_i) must go up (A_good = +1, A_bad = -1)
    optimizer = torch.optim.SGD(lm.parameters(), lr=0.5)
    stats = grpo_update(lm, optimizer, batch, temperature=1.0, clip_eps=0.2, epochs=1, pad_id=tok.pad_id, max_grad_norm=100.0)
    assert stats.trajectories == 2 and stats.tokens == 8
    assert stats.mean_abs_logprob_gap < 1e-5  # the rollout logprobs were the model's own
    after_good, after_bad = seq_logprob(good), seq_logprob(bad)
    assert after_good > before_good + 0.05, (before_good, after_good)
    assert after_bad < before_bad - 0.05, (before_bad, after_bad)


def test_prefix_cache_is_lru_under_its_token_capacity_and_drops_stale_versions():
    cache = PrefixCache(capacity_tokens=10)
    kv = [(torch.zeros(1, 4, 2), torch.zeros(1, 4, 2))]
    cache.put("a", 0, [1, 2, 3, 4], kv)
    cache.put("b", 0, [1, 2, 3, 4], kv)
    assert cache.peek("a", 0) == [1, 2, 3, 4]
    cache.put("c", 0, [5, 6, 7, 8], kv)  # 12 > 10 tokens: the least recently put goes
    assert cache.peek("a", 0) == [] and cache.peek("b", 0) and cache.tokens == 8 and cache.evicted == 1
    cache.put("b", 1, [1], kv[:1])
    assert cache.drop_versions_below(1) == 2 and cache.peek("b", 1) == [1] and cache.peek("c", 0) == []


def test_spec_differences_name_the_field(checkpoint, tmp_path):
    mine = model_spec(load_model(checkpoint), ByteTokenizer())
    other = build_tiny(ModelSection(seed=0, layers=3), tmp_path / "three")
    theirs = model_spec(load_model(other), ByteTokenizer(eos_id=0))
    diff = spec_differences(mine, theirs)
    assert "model config num_hidden_layers: engine 2, trainer 3" in diff
    assert "tokenizer eos_id: engine 256, trainer 0" in diff
    assert spec_differences(mine, mine) == []


def test_weights_round_trip_through_bytes(checkpoint):
    a, b = load_model(checkpoint), load_model(checkpoint)
    with torch.no_grad():
        for p in a.parameters():
            p.add_(0.5)
    load_weights_bytes(b, weights_to_bytes(a))
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_calc_task_rewards_digits_and_its_tool_sums_them():
    task = CalcTask()
    assert task.tool("a1b2c3") == "\n= 1+2+3 = 6\n"
    assert task.reward(["12ab", "x9"]) == pytest.approx(3 / 48)
    assert task.prompt(0, 5) == task.prompt(0, 5) != task.prompt(0, 6)


def test_a_kv_buffer_layer_writes_new_tokens_in_place_and_grows_only_when_full():
    keys, values = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    layer = KvBufferLayer(keys, values, spare=3)
    expected_k, expected_v = keys, values
    storage = layer.keys.untyped_storage().data_ptr()
    for step in range(5):  # 3 fit in the spare room, the 4th grows the buffer
        k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
        got_k, got_v = layer.update(k, v)
        expected_k, expected_v = torch.cat([expected_k, k], dim=2), torch.cat([expected_v, v], dim=2)
        assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
        assert layer.get_seq_length() == 6 + step
        assert (layer.keys.untyped_storage().data_ptr() == storage) == (step < 3)


@pytest.mark.parametrize("lengths", [(9, 9, 9), (9, 4, 13)], ids=["no padding", "left padded"])
def test_batched_decode_matches_a_plain_forward_across_buffer_growth(checkpoint, lengths):
    """Decode more tokens than the KV buffer's spare room (it grows once), with and without
    padding: every sampled token's logits equal one plain forward over prompt + output."""
    model = ModelSection(seed=0, stop_at_eos=False, decode_chunk_tokens=16)
    lm, tok = load_model(checkpoint), ByteTokenizer()
    backend = TorchBackend("e0", lm, tok, model, clock=None, time_scale=1.0)
    backend.record_logits = {}
    out = DECODE_KV_SPARE_TOKENS + 10
    seqs = []
    for i, n in enumerate(lengths):
        seq = Seq(
            work=real_work(f"t{i}", prompt_ids(i, n), out=out), target_tokens=out, cached_prefix_tokens=0, prefill_tokens=n, handoff=False
        )
        backend.admit_prefill(seq)
        backend.execute(Batch([(seq, n)], [], 1, 0.0))
        seq.generated = 1
        seqs.append(seq)
    while seqs[0].decode_left > 0:
        batch = Batch([], list(seqs), 1, 0.0)
        backend.execute(batch)
        for seq in seqs:
            seq.generated += batch.iterations
    for seq in seqs:
        prompt = list(seq.work.token_ids)
        ids, _ = backend.finish(seq)
        assert len(ids) == out
        with torch.inference_mode():
            reference = lm(torch.tensor([prompt + ids])).logits[0]
        recorded = torch.stack(backend.record_logits[seq.key])  # the first token's, then each decode step's
        assert torch.allclose(recorded, reference[len(prompt) - 1 : len(prompt) - 1 + out], atol=1e-4)


def test_a_kv_reply_is_read_as_a_view_of_the_message():
    data = bytes(range(256)) * 64
    message = encode(KvChunk(handle_id="h", ok=True, tokens=3, checksum="crc32:0", data=data))
    view = decode(KvChunkView, message)
    assert view.data.obj is message and bytes(view.data) == data  # no copy of the payload
    assert (view.handle_id, view.ok, view.tokens, view.checksum) == ("h", True, 3, "crc32:0")
    assert decode(KvChunkView, encode(KvChunk(handle_id="h", ok=False, error="gone"))).error == "gone"


def test_kv_checksums_name_their_algorithm_and_are_checked_with_the_one_named():
    data = bytes(range(256)) * 8
    ours = kv_checksum(data)
    # the standard check values of CRC-32C and CRC-32
    assert kv_checksum(b"123456789") == "crc32c:e3069283" and kv_checksum(b"123456789", "crc32") == "crc32:cbf43926"
    parts = [memoryview(data)[:100], memoryview(data)[100:]]  # checked chunk by chunk, no join
    assert kv_checksum_matches(parts, ours) and kv_checksum_matches(parts, kv_checksum(data, "crc32"))
    assert not kv_checksum_matches(parts, kv_checksum(data[:-1] + b"x"))
    assert not kv_checksum_matches(parts, "md5:" + ours.split(":")[1])  # unknown algorithm: no match


def test_held_kv_serialised_ahead_is_what_an_export_at_fetch_time_sends(checkpoint):
    """`held_wire` (at hand-off) + `release` (at the fetch) = `export`: same bytes, tokens and
    checksum; the sequence stays held until released, then its prompt KV is in the prefix cache."""
    lm, tok = load_model(checkpoint), ByteTokenizer()
    backend = TorchBackend("e0", lm, tok, ModelSection(seed=0), clock=None, time_scale=1.0)

    def held(key: str) -> Seq:
        seq = Seq(work=real_work(key, prompt_ids(3, 12)), target_tokens=1, cached_prefix_tokens=0, prefill_tokens=12, handoff=True)
        backend.admit_prefill(seq)
        backend.execute(Batch([(seq, 12)], [], 1, 0.0))
        return seq

    for have in (0, 5, 12):
        exported = (lambda p, n, c: (bytes(p), n, c))(*backend.export(held(f"x{have}").key, have))
        seq = held(f"w{have}")
        payload, tokens, checksum = backend.held_wire(seq.key, have)
        assert seq.key in backend.states and (bytes(payload), tokens, checksum) == exported
        assert tokens == 12 - have and checksum == kv_checksum(payload) and len(payload) == tokens * backend.kv_bytes_per_token
        assert backend.release(seq.key, have) == tokens and seq.key not in backend.states
        assert backend.cache.peek(f"w{have}", 0) == prompt_ids(3, 12)
    seq = held("stale")
    backend.version = 1
    with pytest.raises(KvError, match="policy 0"):
        backend.export(seq.key, 0)
    assert seq.key not in backend.states  # refused and forgotten


def test_the_allocator_is_tuned_once_and_only_where_glibc_is():
    import platform

    first = tune_allocator()
    assert tune_allocator() is first
    if platform.libc_ver()[0] != "glibc":
        assert first is False
