"""The `torch` backend: real prefill, batched decode and real KV tensors for the engine.

The scheduler core decides which sequences run in a step; this module owns their tensors,
keyed by `Seq.key` (the work id), and a prefix cache keyed by trajectory@policy-version:

    admit_prefill(seq) ── prefix-cache hit? ──▶ SeqState(ids, kv of ids[:kv_len])
    execute(batch)  (worker thread) ── prefill chunks on top of each sequence's KV; sample the
                     first token ── decode: one persistent left-padded batch (rows join and
                     leave without rebuilding the rest), k iterations, temperature sampling;
                     its KV sits in buffers with room for new tokens (`kv.KvBufferLayer`), so a
                     step writes one column per layer instead of copying the whole KV
    held_wire(handle, from_tokens) ──▶ bytes of KV positions from_tokens.. + checksum (the
                     actor asks at hand-off); release(handle) when fetched; export = both at once
    admit_decode(seq, item, payload)  ◀── own cached prefix + received suffix
    finish(seq) ──▶ generated ids + logprobs; the KV goes into the prefix cache

KV layout on the wire: float32 [layers, 2 (k, v), kv_heads, tokens, head_dim], C order.
Stale-version KV is never reused: cache keys carry the version, a weights load drops older
entries, and export refuses a handle prefilled under another version.
"""

from __future__ import annotations

import asyncio
import zlib

import torch
from transformers import DynamicCache

from actors.engine.core import Batch, Seq
from actors.engine.torch.kv import KV, DecodeBatch, KvError, PrefixCache, SeqState, common_prefix, kv_cat, kv_len, kv_slice
from actors.engine.torch.model import kv_checksum, load_weights_bytes


class TorchBackend:
    name = "torch"
    repeats_prefill = False  # runs real tokens: one iteration per step whenever a prefill is in it

    def __init__(self, engine_id: str, lm, tokenizer, model, clock, time_scale: float, seed: int = 0) -> None:
        self.engine_id = engine_id
        self.lm = lm
        self.tokenizer = tokenizer
        self.model = model  # actors.config.ModelSection
        self.clock = clock
        self.time_scale = time_scale
        self.device = next(lm.parameters()).device
        self.version = 0
        self.states: dict[str, SeqState] = {}
        self.cache = PrefixCache(model.prefix_cache_tokens)
        self.batch = DecodeBatch()
        self.generator = torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + zlib.crc32(engine_id.encode()))
        self.lock = asyncio.Lock()  # a step and a weights load never overlap
        self.record_logits: dict[str, list[torch.Tensor]] | None = None  # tests: logits per sampled token
        self.last_step_wall_s = 0.0  # wall time of the last step run
        cfg = lm.config
        self.layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.dtype = next(lm.parameters()).dtype

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    # --- admission (event-loop thread) -------------------------------------------------------
    def admit_prefill(self, seq: Seq) -> None:
        """Give the sequence its tokens and whatever prefix of them the cache holds."""
        w = seq.work
        ids = list(w.context_token_ids) + list(w.token_ids)
        if len(w.context_token_ids) != w.context_tokens or len(w.token_ids) != w.new_tokens or not w.token_ids:
            raise KvError(
                f"token ids do not match the counts (context {len(w.context_token_ids)}/{w.context_tokens}, "
                f"new {len(w.token_ids)}/{w.new_tokens})"
            )
        state = SeqState(ids=ids, prompt_len=len(ids), version=w.policy_version)
        cached = self.cache.take(w.trajectory_id, w.policy_version)
        if cached is not None:
            hit = min(common_prefix(cached[0], ids), len(ids) - 1)  # at least one token computes logits
            if hit > 0:
                state.kv = kv_slice(cached[1], 0, hit)
        self.states[seq.key] = state
        seq.cached_prefix_tokens = kv_len(state.kv)
        seq.prefill_tokens = len(ids) - seq.cached_prefix_tokens
        seq.target_tokens = max(1, w.max_output_tokens)

    def local_prefix_tokens(self, trajectory_id: str, version: int, ids: list[int]) -> int:
        """KV tokens this engine already holds for a decode item's sequence (its cached prefix)."""
        return min(common_prefix(self.cache.peek(trajectory_id, version), ids), max(0, len(ids) - 1))

    def admit_decode(self, key: str, w, first_token_id: int, first_logprob: float, have_tokens: int, payload: bytes) -> int:
        """Rebuild a prefilled turn's KV: own cached prefix (have_tokens) + the received positions.
        Returns the sequence's target tokens (1 when the first token already ended the turn)."""
        ids = list(w.context_token_ids) + list(w.token_ids)
        received = self.kv_from_bytes(payload, len(ids) - have_tokens)
        if not 0 <= first_token_id < self.tokenizer.vocab_size:
            raise KvError(f"first token {first_token_id} outside the vocabulary")
        prefix: KV | None = None
        if have_tokens > 0:
            cached = self.cache.take(w.trajectory_id, w.policy_version)
            if cached is None or common_prefix(cached[0], ids) < have_tokens:
                raise KvError("the cached prefix this engine announced is gone")
            prefix = kv_slice(cached[1], 0, have_tokens)
        state = SeqState(ids=ids + [first_token_id], prompt_len=len(ids), version=w.policy_version)
        state.kv = kv_cat(prefix, received)
        state.out_ids, state.out_logprobs = [first_token_id], [first_logprob]
        self.states[key] = state
        return 1 if self._stops(first_token_id) else max(1, w.max_output_tokens)

    # --- one step (worker thread) ------------------------------------------------------------
    async def run(self, batch: Batch, cursor_s: float) -> float:
        async with self.lock:
            started_s = self.clock.now_s()
            await asyncio.to_thread(self.execute, batch)
            batch.prior_s = batch.duration_s  # as planned: the cost model's time for it (engines.preset), the engine's prior
            batch.duration_s = self.clock.now_s() - started_s  # the model seconds the real step took
            self.last_step_wall_s = self.clock.to_wall_s(batch.duration_s)
        return max(cursor_s + batch.duration_s, self.clock.now_s())

    @torch.inference_mode()
    def execute(self, batch: Batch) -> None:
        for seq, n in batch.prefill:
            self._prefill_chunk(seq, n)
        live = [s for s in batch.decode if s.decode_left > 0]
        if not batch.prefill:
            batch.iterations = max(1, min([self.model.decode_chunk_tokens, *(s.decode_left for s in live)]))
        gone = set(self.batch.keys) - {s.key for s in live}
        self.batch.remove(gone, self.states)
        joining = [s.key for s in live if s.key not in set(self.batch.keys)]
        self.batch.add([(key, self.states[key].kv) for key in joining])
        for key in joining:
            self.states[key].kv = None
        if live:
            self._decode(live, batch.iterations)
        finishing = {s.key for s in live if s.generated + batch.iterations >= s.target_tokens}
        self.batch.remove(finishing, self.states)

    def _prefill_chunk(self, seq: Seq, n: int) -> None:
        state = self.states[seq.key]
        start = kv_len(state.kv)
        # a turn cut by a weight update recomputes its tokens so far but the last (the next
        # decode step feeds that one), and samples nothing here: it decodes on from where it was
        resumed = seq.generated_before_prefill > 0
        end = min(start + n, len(state.ids) - 1) if resumed else start + n
        if end <= start:
            return
        chunk = torch.tensor([state.ids[start:end]], device=self.device)
        cache = DynamicCache(ddp_cache_data=[(k[None], v[None]) for k, v in state.kv]) if start else None
        positions = torch.arange(start, end, device=self.device)[None]
        out = self.lm(input_ids=chunk, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
        state.kv = [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]
        if resumed or kv_len(state.kv) < len(state.ids):
            return
        token, logprob = self._sample(out.logits[:, -1], [seq.key])
        state.ids.append(token[0])
        state.out_ids, state.out_logprobs = [token[0]], [logprob[0]]
        if self._stops(token[0]):
            seq.target_tokens = 1

    def _decode(self, live: list[Seq], iterations: int) -> None:
        b = self.batch
        states = [self.states[key] for key in b.keys]
        seqs = {s.key: s for s in live}
        stopped = [False] * len(states)
        cache = b.cache_for(iterations)
        padded = not bool(b.mask.all())  # new columns are never padding: fixed for the whole step
        column = torch.ones(len(states), 1, dtype=torch.long)
        for step in range(iterations):
            last = torch.tensor([[st.ids[-1]] for st in states], device=self.device)
            mask = torch.cat([b.mask, column], dim=1)
            out = self.lm(
                input_ids=last,
                attention_mask=mask.to(self.device) if padded else None,  # no padding: no mask to build
                position_ids=b.pos[:, None].to(self.device),
                past_key_values=cache,
                use_cache=True,
            )
            b.kv = [(layer.keys, layer.values) for layer in cache.layers]
            b.mask, b.pos = mask, b.pos + 1
            tokens, logprobs = self._sample(out.logits[:, -1], b.keys)
            for i, st in enumerate(states):
                if stopped[i]:
                    continue
                st.ids.append(tokens[i])
                st.out_ids.append(tokens[i])
                st.out_logprobs.append(logprobs[i])
                seq = seqs[b.keys[i]]
                if self._stops(tokens[i]):
                    stopped[i] = True
                    seq.target_tokens = seq.generated + step + 1

    def _sample(self, logits: torch.Tensor, keys: list[str]) -> tuple[list[int], list[float]]:
        logp = torch.log_softmax(logits.float() / self.model.temperature, dim=-1)
        tokens = torch.multinomial(logp.exp(), 1, generator=self.generator)[:, 0]
        chosen = logp.gather(1, tokens[:, None])[:, 0]
        if self.record_logits is not None:
            for key, row in zip(keys, logits):
                self.record_logits.setdefault(key, []).append(row.detach().cpu().clone())
        return tokens.tolist(), chosen.tolist()

    def _stops(self, token: int) -> bool:
        return self.model.stop_at_eos and token == self.tokenizer.eos_id

    # --- hand-off, prefill side ----------------------------------------------------------------
    def first_token(self, key: str) -> tuple[int, float]:
        state = self.states[key]
        return state.out_ids[0], state.out_logprobs[0]

    def held_wire(self, key: str, from_tokens: int) -> tuple[memoryview, int, str]:
        """Bytes of the held KV of `key` from position from_tokens on, the token count they cover
        and their checksum; the sequence stays held. The actor calls it at hand-off, so that a
        fetch from that position only sends (`release`), or at the fetch (`export`)."""
        state = self.states.get(key)
        _check_held(state, self.version, from_tokens)
        payload = self.kv_to_bytes(kv_slice(state.kv, from_tokens, state.prompt_len))
        return payload, state.prompt_len - from_tokens, kv_checksum(payload)

    def release(self, key: str, have_tokens: int) -> int:
        """The sequence leaves the held set; its prompt KV stays in the prefix cache. Returns the
        tokens from have_tokens on (what the decode engine receives)."""
        state = self.states.pop(key, None)
        _check_held(state, self.version, have_tokens)
        trajectory_id = key.split("/", 1)[0]
        self.cache.put(trajectory_id, state.version, state.ids[: state.prompt_len], kv_slice(state.kv, 0, state.prompt_len))
        return state.prompt_len - have_tokens

    def export(self, key: str, have_tokens: int) -> tuple[memoryview, int, str]:
        """`held_wire` then `release`: the bytes, tokens and checksum of positions have_tokens on."""
        try:
            wire = self.held_wire(key, have_tokens)
        except KvError:
            self.states.pop(key, None)
            raise
        self.release(key, have_tokens)
        return wire

    def kv_to_bytes(self, kv: KV) -> memoryview:
        """The wire bytes of `kv`: one copy into a contiguous block, viewed, not copied again."""
        if kv_len(kv) == 0:
            return memoryview(b"")
        stacked = torch.stack([t for layer in kv for t in layer])  # [layers * 2, heads, tokens, head_dim]
        return memoryview(stacked.to("cpu").numpy()).cast("B")

    def kv_from_bytes(self, data: bytes | bytearray, tokens: int) -> KV:
        """Tensors viewing `data` (no copy when it is a bytearray: it must not change afterwards)."""
        expected = tokens * self.kv_bytes_per_token
        if len(data) != expected:
            raise KvError(f"KV payload has {len(data)} bytes, {tokens} tokens need {expected}")
        if tokens == 0:
            return []
        flat = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=self.dtype)
        views = flat.reshape(self.layers * 2, self.kv_heads, tokens, self.head_dim).to(self.device).unbind(0)
        return list(zip(views[0::2], views[1::2]))  # one call for all views, not one index per tensor

    # --- the end of a turn ---------------------------------------------------------------------
    def finish(self, seq: Seq) -> tuple[list[int], list[float]]:
        """The turn's generated tokens and logprobs; its KV stays cached for the next turn."""
        state = self.states.pop(seq.key)
        n = seq.generated
        out_ids, out_logprobs = state.out_ids[:n], state.out_logprobs[:n]
        if state.kv is not None:
            keep = min(kv_len(state.kv), state.prompt_len + n - 1)  # the last token has no KV yet
            self.cache.put(seq.work.trajectory_id, state.version, state.ids[:keep], kv_slice(state.kv, 0, keep))
        return out_ids, out_logprobs

    # --- KV write-back (engines.kv_writeback = "to-prefill") -------------------------------------
    def writeback_source(self, trajectory_id: str, version: int) -> tuple[list[int], KV] | None:
        """Decode side, after `finish`: the ids and KV the turn left in the prefix cache (the
        tensors stay alive while the write-back holds them, whatever the cache evicts)."""
        entry = self.cache.entry(trajectory_id, version)
        return None if entry is None else (list(entry[0]), entry[1])

    def writeback_have(self, trajectory_id: str, version: int, ids: list[int]) -> int:
        """Prefill side: KV positions of `ids` this engine's cache holds for the trajectory."""
        return min(common_prefix(self.cache.peek(trajectory_id, version), ids), len(ids))

    def land_writeback(self, trajectory_id: str, version: int, ids: list[int], have: int, payload: bytearray) -> bool:
        """Prefill side: the cached prefix (holding `have` positions of `ids`) + the received
        positions have.. become the cache entry for the trajectory. False, and nothing changes,
        when the entry moved on meanwhile (taken by a turn admitted here, replaced by a longer
        one, or of another version): never a mix of KV from two histories."""
        if version != self.version:
            return False
        received = self.kv_from_bytes(payload, len(ids) - have)
        entry = self.cache.entry(trajectory_id, version)
        if entry is not None and len(entry[0]) >= len(ids):
            return False
        prefix: KV | None = None
        if have > 0:
            if entry is None or common_prefix(entry[0], ids) < have:
                return False
            prefix = kv_slice(entry[1], 0, have)
        self.cache.put(trajectory_id, version, list(ids), kv_cat(prefix, received))
        return self.cache.entry(trajectory_id, version) is not None

    def cut(self, key: str, version: int) -> None:
        """A weight update interrupts the sequence (engines.inflight_on_update = "interrupt"):
        its KV, computed by the old weights, goes; its tokens and logprobs so far stay, and it
        is recomputed under `version` before it decodes on."""
        self.batch.remove({key}, self.states)
        state = self.states.get(key)
        if state is not None:
            state.kv, state.version = None, version

    def drop(self, key: str) -> None:
        """Forget a sequence (expired hand-off, re-prefilled turn)."""
        self.batch.remove({key}, self.states)
        self.states.pop(key, None)

    # --- policy versions -----------------------------------------------------------------------
    async def load_weights(self, data: bytes, version: int) -> int:
        """Load new weights; drop every cached prefix of an older version. Returns entries dropped."""
        async with self.lock:
            await asyncio.to_thread(load_weights_bytes, self.lm, data)
            self.version = version
            return self.cache.drop_versions_below(version)


def _check_held(state: SeqState | None, version: int, from_tokens: int) -> None:
    if state is None:
        raise KvError("no KV behind this handle")
    if state.version != version:
        raise KvError(f"KV was prefilled under policy {state.version}, engine is at {version}")
    if not 0 <= from_tokens <= state.prompt_len:
        raise KvError(f"have_tokens {from_tokens} outside 0..{state.prompt_len}")
