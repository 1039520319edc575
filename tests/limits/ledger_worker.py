"""A real process running the real ledger (Ledger) over the host data plane, with a shared record.

Started by ``test_ledger_integration.py``; one JSON line per command on stdin:

    fill                alloc one block at a time until the ledger says None (pressure); how many it got
    free N              free the N most recently allocated blocks
    maintain            one engine step of housekeeping (applies kvctl changes seen in the record)
    state               charged bytes (ledger and record), bytes the host backend really holds, used blocks
    close               tear the pool down (unmap everything, close the record)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from elastic_kv import _vmm
from elastic_kv.config import ElasticConfig
from elastic_kv.geometry import BlockGeometry
from elastic_kv.ledger import Ledger
from elastic_kv.ledger.page_mapper import LocalMapper
from elastic_kv.registry import PoolRecord

BLOCK = 16 << 10
PAGE = 64 << 10  # 4 blocks per page
BLOCKS = 256


def reply(payload: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--limit", type=int, default=0)
    args = parser.parse_args()

    geometry = BlockGeometry.from_layer_strides(
        BLOCKS * BLOCK, BLOCKS, 1, BLOCKS * BLOCK, BLOCK, BLOCK, PAGE, max_page_slots=1
    )
    backend = _vmm.HostBackend()
    pool = _vmm.HandlePool(backend, 0)  # no handle cache: an unmapped page gives its memory back
    spaces = [_vmm.TensorSpace(backend, size, PAGE) for size in geometry.space_sizes]
    group = _vmm.SpaceGroup(spaces, geometry.extent_tuples(), geometry.num_pages, pool)
    record = PoolRecord.create(
        args.name, device="host:0", engine="test", model="tiny", limit_bytes=args.limit
    )
    config = ElasticConfig(page_size=PAGE, reserve_min_pages=0, reserve_max_pages=0, premap=False,
                           limit_bytes=args.limit, publish_interval_s=0.0)  # fmt: skip
    ledger = Ledger(geometry, LocalMapper(group), config, record=record, name=args.name)
    reply({"ready": True, "page_bytes": geometry.page_bytes})

    live: list[int] = []
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "fill":
            got = 0
            while (ids := ledger.alloc(1)) is not None:
                live.extend(ids)
                got += 1
            reply({"got": got})
        elif cmd == "free":
            n = int(rest[0])
            ledger.free(live[-n:])
            del live[-n:]
            reply({"ok": True})
        elif cmd == "maintain":
            ledger.maintain()
            reply({"ok": True})
        elif cmd == "state":
            reply({"charged": ledger.charged_bytes, "record_charged": record.charged_bytes,
                   "backed": group.mapped_bytes, "host_bytes": backend.live_bytes, "used": ledger.used_blocks,
                   "limit": record.limit_bytes})  # fmt: skip
        elif cmd == "close":
            ledger.close()
            record.close()
            reply({"ok": True})


if __name__ == "__main__":
    main()
