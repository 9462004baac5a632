"""The record format (hiradix/storage/file/records.py): headers pack, parse and verify."""

from __future__ import annotations

import zlib

import pytest

from hiradix.storage.base import MAX_KEY_BYTES
from hiradix.storage.file.records import (
    BODY,
    CRC32_IMPL,
    FLAG_LZ4,
    HDR_SIZE,
    MAGIC,
    crc32,
    header,
    header_ok,
    parse_header,
)


def test_a_header_round_trips() -> None:
    crc = crc32(b"payload")
    head = header(b"key", FLAG_LZ4, 5, 7, 42, crc)
    assert len(head) == HDR_SIZE and head.startswith(MAGIC)
    assert parse_header(head) == (FLAG_LZ4, 3, 5, 7, 42, crc)
    assert parse_header(head + b"key and more") == (FLAG_LZ4, 3, 5, 7, 42, crc)  # reads the fixed part only
    assert header_ok(head, b"key")


def test_crc32_is_zlibs_whichever_computes_it() -> None:
    data = bytes(range(256)) * 9
    assert CRC32_IMPL in ("isal", "zlib")
    assert crc32(data) == zlib.crc32(data) and crc32(b"b", crc32(b"a")) == zlib.crc32(b"ab")


@pytest.mark.parametrize(
    "fields",
    [
        (b"XXXX", 1, 0, 3, 0, 4, 4, 1, 0),  # magic
        (MAGIC, 2, 0, 3, 0, 4, 4, 1, 0),  # version
        (MAGIC, 1, 2, 3, 0, 4, 4, 1, 0),  # an unknown flag
        (MAGIC, 1, 0, 0, 0, 4, 4, 1, 0),  # no key
        (MAGIC, 1, 0, MAX_KEY_BYTES + 1, 0, 4, 4, 1, 0),  # a key too long
        (MAGIC, 1, 0, 3, 0, 3, 4, 1, 0),  # uncompressed, yet stored != raw
    ],
    ids=["magic", "version", "flag", "no-key", "long-key", "lengths"],
)
def test_a_bad_fixed_part_is_no_header(fields: tuple) -> None:
    assert parse_header(BODY.pack(*fields) + bytes(4)) is None


def test_a_short_buffer_is_no_header() -> None:
    assert parse_header(header(b"k", 0, 1, 1, 1, 0)[:-1]) is None


def test_the_header_checksum_covers_fields_and_key() -> None:
    head = bytearray(header(b"key", 0, 4, 4, 9, 123))
    assert header_ok(head, b"key") and not header_ok(head, b"kez")
    head[20] ^= 1  # a bit of stored_len
    assert not header_ok(head, b"key")
