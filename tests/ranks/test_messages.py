"""The wire format: exact round trips, strict decoding, frozen prefix."""

from __future__ import annotations

import struct

import pytest
from elastic_kv.ranks.messages import (
    PROTOCOL_VERSION,
    Code,
    MessageError,
    Op,
    RankInfo,
    Reply,
    Request,
    Status,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    peek_prefix,
)
from hypothesis import given
from hypothesis import strategies as st

u64 = st.integers(0, 2**64 - 1)
pages = st.lists(st.integers(0, 2**32 - 1), max_size=300).map(tuple)

requests = st.builds(
    Request,
    op=st.sampled_from(Op),
    request_id=u64,
    pool=st.integers(0, 2**16 - 1),
    tx=u64,
    pages=pages,
    epoch=u64,
    finished_epoch=u64,
)
infos = st.builds(
    RankInfo,
    pid=st.integers(0, 2**32 - 1),
    num_pages=st.integers(0, 2**32 - 1),
    num_mapped=st.integers(0, 2**32 - 1),
    queued_unmaps=st.integers(0, 2**32 - 1),
    consistent=st.booleans(),
    live_handles=u64,
    cached_handles=u64,
    mapped_bytes=u64,
    finished_epoch=u64,
    last_tx=u64,
)
replies = st.builds(
    Reply,
    request_id=u64,
    rank=st.integers(0, 2**32 - 1),
    status=st.sampled_from(Status),
    code=st.sampled_from(Code),
    pool=st.integers(0, 2**16 - 1),
    message=st.text(max_size=200),
    pages=pages,
    info=st.none() | infos,
)


@given(requests)
def test_request_round_trip(req: Request) -> None:
    data = encode_request(req)
    assert decode_request(data) == req
    assert decode_request(memoryview(data)) == req
    assert peek_prefix(data) == (PROTOCOL_VERSION, int(req.op), req.request_id)


@given(replies)
def test_reply_round_trip(rep: Reply) -> None:
    assert decode_reply(encode_reply(rep)) == rep


@given(requests, st.integers(1, 8))
def test_any_truncation_or_padding_is_rejected(req: Request, cut: int) -> None:
    data = encode_request(req)
    with pytest.raises(MessageError):
        decode_request(data[:-cut] if cut <= len(data) else b"")
    with pytest.raises(MessageError):
        decode_request(data + b"\x00" * cut)


def test_prefix_layout_is_frozen() -> None:
    """The first 12 bytes (magic, version, kind, request id) must never change across versions."""
    data = encode_request(Request(Op.MAP, 0x0102030405060708, 3, 9, (7,)))
    assert data[:12] == b"EK" + bytes([PROTOCOL_VERSION, 1]) + struct.pack("<Q", 0x0102030405060708)
    assert len(data) == 44 + 4  # header + one page


def test_encoding_rejects_values_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="pool"):
        encode_request(Request(Op.MAP, 1, pool=1 << 16))
    with pytest.raises(ValueError, match="tx"):
        encode_request(Request(Op.MAP, 1, tx=-1))
    with pytest.raises(ValueError, match="page"):
        encode_request(Request(Op.MAP, 1, tx=1, pages=(1 << 32,)))
    with pytest.raises(ValueError, match="page"):
        encode_request(Request(Op.MAP, 1, tx=1, pages=(-1,)))


def test_reply_is_not_a_request_and_vice_versa() -> None:
    req = encode_request(Request(Op.STATUS, 5))
    rep = encode_reply(Reply(5, 0, Status.OK))
    with pytest.raises(MessageError, match="not a reply"):
        decode_reply(req)
    with pytest.raises(MessageError) as info:
        decode_request(rep)
    assert info.value.code is Code.UNKNOWN_OP and info.value.request_id == 5


def test_reply_with_unknown_status_is_rejected() -> None:
    data = bytearray(encode_reply(Reply(5, 0, Status.OK)))
    data[16] = 9  # the status byte
    with pytest.raises(MessageError, match="unknown status"):
        decode_reply(bytes(data))
