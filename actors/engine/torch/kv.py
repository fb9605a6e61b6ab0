"""Real KV tensors of the `torch` backend: the per-layer KV of one sequence, the prefix
cache keyed by trajectory@policy-version, and the decode batch, whose KV sits in buffers
with room for new tokens (`KvBufferLayer`) so that a decode step writes one column per layer
instead of copying the whole KV. `backend.TorchBackend` drives them. At the end, the KV
on the wire as `actor.py` serves (`Outgoing`) and reads it (`KvChunkView`)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import torch
from transformers.cache_utils import Cache, DynamicLayer

from bus_schemas.work import KvChunk

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [kv_heads, tokens, head_dim]


class KvError(ValueError):
    """KV that cannot be used (stale, wrong size); the caller re-prefills the turn."""


def kv_len(kv: KV | None) -> int:
    return 0 if not kv else kv[0][0].shape[1]


def kv_slice(kv: KV, start: int, stop: int | None = None) -> KV:
    if start == 0 and (stop is None or stop >= kv_len(kv)):
        return list(kv)  # all of it: no view per tensor (on the hand-off's path)
    return [(k[:, start:stop], v[:, start:stop]) for k, v in kv]


def kv_cat(a: KV | None, b: KV) -> KV:
    if not a or kv_len(a) == 0:
        return b
    return [(torch.cat([ka, kb], dim=1), torch.cat([va, vb], dim=1)) for (ka, va), (kb, vb) in zip(a, b)]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """trajectory@version -> (token ids, KV of those ids); LRU under a capacity in tokens."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[tuple[str, int], tuple[list[int], KV]] = OrderedDict()
        self.tokens = 0
        self.evicted = 0

    def peek(self, trajectory_id: str, version: int) -> list[int]:
        entry = self._entries.get((trajectory_id, version))
        return [] if entry is None else entry[0]

    def entry(self, trajectory_id: str, version: int) -> tuple[list[int], KV] | None:
        """The cached (ids, KV) without taking it (a KV write-back holds a reference to it)."""
        return self._entries.get((trajectory_id, version))

    def take(self, trajectory_id: str, version: int) -> tuple[list[int], KV] | None:
        entry = self._entries.pop((trajectory_id, version), None)
        if entry is not None:
            self.tokens -= len(entry[0])
        return entry

    def put(self, trajectory_id: str, version: int, ids: list[int], kv: KV) -> None:
        self.take(trajectory_id, version)
        if len(ids) > self.capacity_tokens:
            return
        self._entries[(trajectory_id, version)] = (ids, kv)
        self.tokens += len(ids)
        while self.tokens > self.capacity_tokens:
            _, (old_ids, _) = self._entries.popitem(last=False)
            self.tokens -= len(old_ids)
            self.evicted += 1

    def drop_versions_below(self, version: int) -> int:
        stale = [key for key in self._entries if key[1] < version]
        for trajectory_id, v in stale:
            self.take(trajectory_id, v)
        return len(stale)


@dataclass(slots=True)
class SeqState:
    ids: list[int]  # the whole sequence: context + new tokens (+ tokens generated this turn)
    prompt_len: int  # context + new tokens
    version: int
    kv: KV | None = None  # KV of ids[:kv_len]; None while the row lives in the decode batch
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)


DECODE_KV_SPARE_TOKENS = 64  # room the decode batch's KV keeps for new tokens: it is copied once per this many steps


class KvBufferLayer(DynamicLayer):
    """One layer of the decode batch's KV in a buffer [rows, kv_heads, capacity, head_dim] whose
    first `length` columns are in use. A step writes its new column in place; `DynamicLayer`
    concatenates instead, a copy of the whole KV (and a fresh allocation) per token and layer.
    The buffer is copied into a larger one only when full."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, spare: int) -> None:
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.spare = max(1, spare)
        self._allocate(keys, values, keys.shape[2] + self.spare)

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        rows, heads, length, head_dim = keys.shape
        self._k = keys.new_empty(rows, heads, capacity, head_dim)
        self._v = values.new_empty(rows, heads, capacity, head_dim)
        self._k[:, :, :length] = keys
        self._v[:, :, :length] = values
        self.length = length
        self.keys, self.values = self._k[:, :, :length], self._v[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[2]
        if end > self._k.shape[2]:
            self._allocate(self.keys, self.values, end + self.spare)
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


class DecodeBatch:
    """Sequences decoding together: one left-padded KV per layer [rows, heads, L, head_dim]."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.kv: KV = []  # views of the cache's buffers while `cache` is set
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.pos = torch.zeros(0, dtype=torch.long)  # next position of each row (= its true length)
        self.cache: Cache | None = None  # buffers holding `kv` while the rows stay the same (no copy per step)

    def cache_for(self, steps: int) -> Cache:
        """The model's cache over the batch's KV, with room for at least `steps` more tokens."""
        if self.cache is None:
            spare = max(steps, DECODE_KV_SPARE_TOKENS)
            self.cache = Cache(layers=[KvBufferLayer(k, v, spare) for k, v in self.kv])
        return self.cache

    def remove(self, keys: set[str], states: dict[str, SeqState]) -> None:
        """Take rows out, giving each its unpadded KV back."""
        if not keys & set(self.keys):
            return
        self.cache = None
        length = self.mask.shape[1]
        for i, key in enumerate(self.keys):
            if key in keys and key in states:
                n = int(self.pos[i])
                states[key].kv = [(k[i, :, length - n :].clone(), v[i, :, length - n :].clone()) for k, v in self.kv]
        keep = [i for i, key in enumerate(self.keys) if key not in keys]
        index = torch.tensor(keep, dtype=torch.long)
        self.keys = [self.keys[i] for i in keep]
        self.kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.kv]
        self.mask, self.pos = self.mask.index_select(0, index), self.pos.index_select(0, index)
        self._trim()

    def add(self, rows: list[tuple[str, KV]]) -> None:
        """Rows join together: one concatenation per layer however many join (each row's KV is
        copied once, left-padded, into the new block)."""
        if not rows:
            return
        self.cache = None
        lengths = [kv_len(kv) for _, kv in rows]
        length = max(*lengths, self.mask.shape[1])
        self._pad_to(length)
        block = [
            (_stack_left_padded([kv[i][0] for _, kv in rows], length), _stack_left_padded([kv[i][1] for _, kv in rows], length))
            for i in range(len(rows[0][1]))
        ]
        self.kv = block if not self.keys else [(torch.cat([bk, rk]), torch.cat([bv, rv])) for (bk, bv), (rk, rv) in zip(self.kv, block)]
        block_mask = (torch.arange(length)[None] >= length - torch.tensor(lengths)[:, None]).long()
        self.mask = torch.cat([self.mask, block_mask]) if self.keys else block_mask
        self.pos = torch.cat([self.pos, torch.tensor(lengths)])
        self.keys.extend(key for key, _ in rows)

    def _pad_to(self, length: int) -> None:
        extra = length - self.mask.shape[1]
        if extra <= 0 or not self.keys:
            return
        self.kv = [(torch.nn.functional.pad(k, (0, 0, extra, 0)), torch.nn.functional.pad(v, (0, 0, extra, 0))) for k, v in self.kv]
        self.mask = torch.nn.functional.pad(self.mask, (extra, 0))

    def _trim(self) -> None:
        """Drop leading columns that are padding in every row."""
        if not self.keys:
            self.kv, self.mask, self.pos = [], torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
            return
        drop = self.mask.shape[1] - int(self.pos.max())
        if drop > 0:
            self.kv = [(k[:, :, drop:], v[:, :, drop:]) for k, v in self.kv]
            self.mask = self.mask[:, drop:]


def _stack_left_padded(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """[heads, n_i, head_dim] each -> [rows, heads, length, head_dim], row i right-aligned."""
    heads, _, head_dim = rows[0].shape
    out = rows[0].new_zeros(len(rows), heads, length, head_dim)
    for i, t in enumerate(rows):
        out[i, :, length - t.shape[1] :] = t
    return out


# --- KV on the wire -------------------------------------------------------------------------
# A KvChunk as the decode side reads it: `data` a view into the received message, not a copy
# (msgspec decodes msgpack bin into a memoryview without copying). Same fields, same wire format.
KvChunkView = msgspec.defstruct(
    "KvChunkView",
    [
        (f.name, memoryview, f.default) if f.name == "data" else (f.name, f.type) if f.required else (f.name, f.type, f.default)
        for f in msgspec.structs.fields(KvChunk)
    ],
    kw_only=True,
    frozen=True,
)


@dataclass(slots=True)
class Outgoing:
    """A KV transfer being served, or prepared at hand-off: kept until every chunk is fetched."""

    replies: list[bytes | memoryview]  # chunk i: its encoded reply (prepared) or a view of its bytes
    checksum: str
    tokens: int
    start_tokens: int
    total_bytes: int
    expires_at_s: float = 0.0
    served: set[int] = field(default_factory=set)
