"""The emulated engine's prefix cache (pure): the KV of a returning trajectory's history, keyed
by trajectory and policy version (an older policy's KV is never reused), kept LRU in the part
of the KV pool that sequences do not occupy. Tokens only; the torch backend keeps the tensors
(`PrefixCache` in actors/engine/torch/kv.py).

With a host tier (`engines.host_kv_tier`, SGLang's hierarchical cache), an entry the GPU LRU
evicts moves to a host-memory LRU of `host_capacity_tokens` instead of being lost; taking it
later loads it back over the host link (the caller charges the copy, `take_split`). The copy
to host is written through in the background, off the step's critical path, as SGLang's
HiCache does by default; only the load back is charged."""

from __future__ import annotations

from collections import OrderedDict


def key(trajectory_id: str, policy_version: int) -> str:
    return f"{trajectory_id}@{policy_version}"


class PrefixLru:
    def __init__(self, host_capacity_tokens: int = 0) -> None:
        self._entries: OrderedDict[str, int] = OrderedDict()  # on the GPU, oldest first
        self._host: OrderedDict[str, int] = OrderedDict()  # in host memory, oldest first
        self.host_capacity_tokens = host_capacity_tokens  # 0: no host tier
        self.tokens = 0  # cached on the GPU in all
        self.host_tokens = 0  # cached in host memory in all

    def get(self, trajectory_id: str, policy_version: int) -> int:
        """Tokens cached for (trajectory, version) in either tier, left in place."""
        k = key(trajectory_id, policy_version)
        return self._entries.get(k, 0) or self._host.get(k, 0)

    def take(self, trajectory_id: str, policy_version: int) -> int:
        """Remove the entry (its turn is admitted: the KV becomes the sequence's); its tokens."""
        return sum(self.take_split(trajectory_id, policy_version))

    def take_split(self, trajectory_id: str, policy_version: int) -> tuple[int, int]:
        """`take`, as (tokens found on the GPU, tokens to load back from host memory)."""
        k = key(trajectory_id, policy_version)
        gpu = self._entries.pop(k, 0)
        self.tokens -= gpu
        host = self._host.pop(k, 0)
        self.host_tokens -= host
        return (gpu, 0) if gpu else (0, host)

    def peek(self, entry_key: str) -> tuple[int, int]:
        """(GPU tokens, host tokens) cached under `entry_key` (`key`), left in place: a shared
        entry (a task's prompt) serves several sequences without being taken."""
        return self._entries.get(entry_key, 0), self._host.get(entry_key, 0)

    def put(self, trajectory_id: str, policy_version: int, tokens: int, free_tokens: int) -> None:
        """Cache `tokens` for (trajectory, version) as the newest entry, then evict the oldest
        until the cache fits `free_tokens` (an entry that alone does not fit goes too)."""
        self.put_key(key(trajectory_id, policy_version), tokens, free_tokens)

    def put_key(self, entry_key: str, tokens: int, free_tokens: int) -> None:
        self._drop(entry_key)
        self._entries[entry_key] = tokens
        self.tokens += tokens
        while self._entries and self.tokens > free_tokens:
            evicted_key, evicted = self._entries.popitem(last=False)
            self.tokens -= evicted
            self._to_host(evicted_key, evicted)

    def _drop(self, entry_key: str) -> None:
        self.tokens -= self._entries.pop(entry_key, 0)
        self.host_tokens -= self._host.pop(entry_key, 0)

    def _to_host(self, entry_key: str, tokens: int) -> None:
        """An entry the GPU evicted, kept in host memory while it fits (oldest go first)."""
        if tokens > self.host_capacity_tokens:
            return
        self._host[entry_key] = tokens
        self.host_tokens += tokens
        while self.host_tokens > self.host_capacity_tokens:
            _, gone = self._host.popitem(last=False)
            self.host_tokens -= gone

    def entries_below(self, version: int) -> list[str]:
        """Keys ("trajectory@version") of the entries of a policy older than `version`, both tiers."""
        return [k for k in (*self._entries, *self._host) if int(k.rsplit("@", 1)[1]) < version]

    def drop_below(self, version: int) -> int:
        """Forget every entry of a policy older than `version`; the entries dropped."""
        stale = self.entries_below(version)
        for k in stale:
            self._drop(k)
        return len(stale)
