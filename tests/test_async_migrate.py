"""A decode migrated mid-turn (a role switch's hand-off) keeps the version of its first tokens
when a weight update had interrupted it, so the trainer's staleness counts the old tokens."""

from __future__ import annotations

from bus_schemas.codec import decode, encode
from bus_schemas.control import Role
from bus_schemas.work import DecodeWork, KvHandle
from tests.test_engine_core import core, work


def test_a_migrated_decode_keeps_the_version_of_its_first_tokens():
    w = work("a", context=500, new=100, out=40, version=1)
    handle = KvHandle(engine_id="e9", handle_id=w.work_id, tokens=600, kv_bytes=1, expires_at_s=1.0)
    migrated = DecodeWork(prefill=w, kv=handle, prefilled_at_s=0.0, generated_tokens=7, migrated_from="e9", oldest_policy_version=0)
    item = decode(DecodeWork, encode(migrated))  # as it crosses the bus
    seq = core(role=Role.DECODE).admit_decode(item)
    assert seq.oldest_version == 0 and seq.generated == 7
    fresh = core(role=Role.DECODE).admit_decode(DecodeWork(prefill=w, kv=handle, prefilled_at_s=0.0))
    assert fresh.oldest_version == -1  # a fresh turn: all of it on its own version
