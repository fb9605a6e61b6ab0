"""Encoding and decoding at the edge: one msgpack decoder per message type."""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


@cache
def decoder(message_type: Any) -> msgspec.msgpack.Decoder:
    """A cached decoder for a Struct type or a union of tagged Structs."""
    return msgspec.msgpack.Decoder(message_type)


def decode(message_type: type[T], data: bytes) -> T:
    """Decode or raise msgspec.DecodeError / msgspec.ValidationError."""
    return decoder(message_type).decode(data)
