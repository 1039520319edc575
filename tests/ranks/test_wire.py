"""Duplicate, late, unknown and malformed messages, sent raw through each transport."""

from __future__ import annotations

import itertools
import os
import socket
import struct

import pytest
from elastic_kv.ranks.messages import (
    PROTOCOL_VERSION,
    Code,
    Op,
    Reply,
    Request,
    Status,
    decode_reply,
    encode_request,
)
from elastic_kv.ranks.transport import NoReply, Outcome
from ranks_harness import Cluster

_ids = itertools.count(1_000_000)


def _send(
    cluster: Cluster, transport: object, pool: int, op: Op, tx: int, pages: tuple[int, ...] = ()
) -> Code:
    """Broadcast one raw request; every rank must answer the same; return the code (NONE when done)."""
    outcomes: list[Outcome] = transport.broadcast(Request(op, next(_ids), pool, tx, pages), 5.0)  # type: ignore[attr-defined]
    assert all(isinstance(o, Reply) for o in outcomes), outcomes
    codes = {o.code for o in outcomes if isinstance(o, Reply)}
    assert len(codes) == 1, outcomes
    return codes.pop()


def test_duplicate_late_and_unknown_requests(cluster: Cluster, pool: int) -> None:
    t = cluster.transport()
    ok, refused = Code.NONE, Code.REFUSED
    # Duplicates are answered like the original and change nothing.
    assert _send(cluster, t, pool, Op.MAP, 10, (1,)) == ok
    assert _send(cluster, t, pool, Op.MAP, 10, (1,)) == ok
    cluster.assert_agree(pool, [1])
    # A MAP arriving after its ROLLBACK is refused.
    assert _send(cluster, t, pool, Op.ROLLBACK, 10) == ok
    assert _send(cluster, t, pool, Op.ROLLBACK, 10) == ok
    assert _send(cluster, t, pool, Op.MAP, 10, (1,)) == refused
    cluster.assert_agree(pool, [])
    # An ABORT for a PREPARE that never arrived leaves a tombstone: the late PREPARE is refused.
    assert _send(cluster, t, pool, Op.MAP, 11, (2, 3)) == ok
    assert _send(cluster, t, pool, Op.ABORT, 20) == ok
    assert _send(cluster, t, pool, Op.PREPARE, 20, (2,)) == refused
    assert _send(cluster, t, pool, Op.COMMIT, 20) == refused
    # A ROLLBACK for a MAP that never arrived, likewise.
    assert _send(cluster, t, pool, Op.ROLLBACK, 21) == ok
    assert _send(cluster, t, pool, Op.MAP, 21, (4,)) == refused
    # A request for an older transaction the rank never saw is a late message: refused.
    assert _send(cluster, t, pool, Op.PREPARE, 15, (2,)) == refused
    assert _send(cluster, t, pool, Op.MAP, 12, (5,)) == refused
    cluster.assert_agree(pool, [2, 3])
    # Two-phase unmap: duplicate PREPARE/COMMIT are idempotent; ABORT after COMMIT is refused.
    assert _send(cluster, t, pool, Op.PREPARE, 30, (2,)) == ok
    assert _send(cluster, t, pool, Op.PREPARE, 30, (2,)) == ok
    assert _send(cluster, t, pool, Op.COMMIT, 30) == ok
    assert _send(cluster, t, pool, Op.COMMIT, 30) == ok
    assert _send(cluster, t, pool, Op.ABORT, 30) == refused
    cluster.assert_agree(pool, [3])
    # ... and COMMIT after ABORT is refused; duplicate ABORT is fine.
    assert _send(cluster, t, pool, Op.PREPARE, 31, (3,)) == ok
    assert _send(cluster, t, pool, Op.ABORT, 31) == ok
    assert _send(cluster, t, pool, Op.ABORT, 31) == ok
    assert _send(cluster, t, pool, Op.COMMIT, 31) == refused
    cluster.assert_agree(pool, [3])
    # Kinds do not mix; unknown transactions and pools are named as such.
    assert _send(cluster, t, pool, Op.ROLLBACK, 31) == refused
    assert _send(cluster, t, pool, Op.ABORT, 11) == refused
    assert _send(cluster, t, pool, Op.COMMIT, 99) == Code.UNKNOWN_TX
    assert _send(cluster, t, pool, Op.MAP, 0, (6,)) == Code.BAD_ARGUMENT
    assert _send(cluster, t, pool + 1000, Op.MAP, 40, (6,)) == Code.UNKNOWN_POOL
    cluster.assert_agree(pool, [3])
    # A coordinator built now starts above every transaction id the ranks have seen.
    c = cluster.coordinator(pool)
    c.map([6])
    c.unmap([3])
    cluster.assert_agree(pool, [6])


def _raw_round_trip(cluster: Cluster, data: bytes) -> list[Outcome]:
    """Hand ``data`` to every rank as one request through the cluster's transport, at the byte level."""
    if cluster.kind == "inproc":
        return [decode_reply(node.rank.handle(data)) for node in cluster.nodes]
    if cluster.kind == "rpc":
        return [decode_reply(r) for r in cluster._rpc_call(data, 5.0)]
    outcomes: list[Outcome] = []
    for path in cluster.paths:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(os.fspath(path))
            s.sendall(struct.pack("<I", len(data)) + data)
            outcomes.append(decode_reply(_recv_frame(s)))
    return outcomes


def _recv_frame(s: socket.socket) -> bytes:
    s.settimeout(5)
    head = b""
    while len(head) < 4:
        head += s.recv(4 - len(head))
    (n,) = struct.unpack("<I", head)
    body = b""
    while len(body) < n:
        body += s.recv(n - len(body))
    return body


GOOD = encode_request(Request(Op.STATUS, 77, 1))
MALFORMED = [
    ("empty", b"", Code.MALFORMED),
    ("garbage", b"\x00" * 64, Code.MALFORMED),
    ("truncated", GOOD[:-3], Code.MALFORMED),
    ("padded", GOOD + b"\x00", Code.MALFORMED),
    ("pages-overrun", GOOD[:-4] + struct.pack("<I", 5), Code.MALFORMED),
    ("pickle", b"\x80\x04\x95" + b"\x00" * 40, Code.MALFORMED),
    ("version", GOOD[:2] + bytes([PROTOCOL_VERSION + 1]) + GOOD[3:], Code.VERSION),
    ("unknown-op", GOOD[:3] + bytes([99]) + GOOD[4:], Code.UNKNOWN_OP),
]


@pytest.mark.parametrize(("name", "data", "code"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_requests_get_an_error_reply(
    cluster: Cluster, pool: int, name: str, data: bytes, code: Code
) -> None:
    outcomes = _raw_round_trip(cluster, data)
    for o in outcomes:
        assert isinstance(o, Reply) and o.status is Status.ERROR and o.code is code, (name, o)
        if code is not Code.MALFORMED or name in ("truncated", "padded", "pages-overrun"):
            assert o.request_id == 77  # the id is echoed whenever the prefix is readable
    # The ranks still serve the protocol.
    c = cluster.coordinator(pool)
    c.map([1])
    cluster.assert_agree(pool, [1])


def test_unframeable_stream_closes_only_that_connection(cluster: Cluster, pool: int) -> None:
    if cluster.kind != "socket":
        pytest.skip("framing exists on the socket transport only")
    c = cluster.coordinator(pool)
    c.map([1])  # the coordinator's connections are open
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(os.fspath(cluster.paths[0]))
        s.sendall(struct.pack("<I", 0xFFFFFFF0) + b"x" * 16)  # a length no message can have
        reply = decode_reply(_recv_frame(s))
        assert reply.code is Code.MALFORMED and "limit" in reply.message
        assert s.recv(1) == b""  # the listener closed this connection
    c.map([2])  # ... and kept the others and itself
    cluster.assert_agree(pool, [1, 2])


def test_no_reply_is_reported_per_rank(cluster: Cluster, pool: int) -> None:
    if cluster.kind != "socket":
        pytest.skip("per-rank outcomes on a dead rank need a transport that reaches ranks separately")
    t = cluster.transport()
    assert _send(cluster, t, pool, Op.MAP, 5, (1,)) == Code.NONE
    cluster.kill(1)
    outcomes = t.broadcast(Request(Op.STATUS, next(_ids), pool), 2.0)
    assert isinstance(outcomes[0], Reply) and isinstance(outcomes[2], Reply)
    assert isinstance(outcomes[1], NoReply) and outcomes[1].gone
