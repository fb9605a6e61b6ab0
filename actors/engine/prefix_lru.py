"""The emulated engine's prefix cache (pure): the KV of a returning trajectory's history, keyed
by trajectory and policy version (an older policy's KV is never reused), kept LRU in the part
of the KV pool that sequences do not occupy. Tokens only; the torch backend keeps the tensors
(`PrefixCache` in actors/engine/torch/kv.py)."""

from __future__ import annotations

from collections import OrderedDict


def _key(trajectory_id: str, policy_version: int) -> str:
    return f"{trajectory_id}@{policy_version}"


class PrefixLru:
    def __init__(self) -> None:
        self._entries: OrderedDict[str, int] = OrderedDict()  # oldest first
        self.tokens = 0  # cached in all

    def get(self, trajectory_id: str, policy_version: int) -> int:
        """Tokens cached for (trajectory, version), left in place."""
        return self._entries.get(_key(trajectory_id, policy_version), 0)

    def take(self, trajectory_id: str, policy_version: int) -> int:
        """Remove the entry (its turn is admitted: the KV becomes the sequence's); its tokens."""
        tokens = self._entries.pop(_key(trajectory_id, policy_version), 0)
        self.tokens -= tokens
        return tokens

    def put(self, trajectory_id: str, policy_version: int, tokens: int, free_tokens: int) -> None:
        """Cache `tokens` for (trajectory, version) as the newest entry, then evict the oldest
        until the cache fits `free_tokens` (an entry that alone does not fit goes too)."""
        self.take(trajectory_id, policy_version)
        self._entries[_key(trajectory_id, policy_version)] = tokens
        self.tokens += tokens
        while self._entries and self.tokens > free_tokens:
            _, evicted = self._entries.popitem(last=False)
            self.tokens -= evicted

    def entries_below(self, version: int) -> list[str]:
        """Keys ("trajectory@version") of the entries of a policy older than `version`."""
        return [k for k in self._entries if int(k.rsplit("@", 1)[1]) < version]

    def drop_below(self, version: int) -> int:
        """Forget every entry of a policy older than `version`; the entries dropped."""
        stale = self.entries_below(version)
        for k in stale:
            self.tokens -= self._entries.pop(k)
        return len(stale)
