"""The state pool of a Mamba / linear hybrid at SGLang's own default size: reserved vs mapped bytes.

Starts one elastic SGLang CPU engine on the tiny Qwen3-Next of :mod:`tests.support.sglang_models` without
``--max-mamba-cache-size`` (SGLang sizes the state pool from the memory it finds, and natively allocates
all of it at start-up), then prints the ``<name>-mamba`` pool's reservation, what is mapped idle, the peak
while a batch of 16 requests runs, and what is mapped after ``flush_cache``.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/sglang_mamba_state.py
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from tests.support.sglang_engine import generate_watching_peaks, settled_snapshot, start_engine
from tests.support.sglang_models import GDN_ENGINE_ENV, tiny_gdn_model

BATCH = [[(11 * i + j) % 900 + 10 for j in range(32)] for i in range(16)]


def main() -> None:
    registry = Path(tempfile.mkdtemp())
    os.chmod(registry, 0o700)
    env = {
        **GDN_ENGINE_ENV,
        "ELASTIC_KV_REGISTRY_DIR": str(registry),
        "ELASTIC_KV_POOL_NAME": "bench",
        "ELASTIC_KV_PUBLISH_INTERVAL_S": "0",
    }
    with start_engine(
        "gdn-state-bench",
        tiny_gdn_model(),
        backend="elastic",
        env=env,
        start_timeout_s=900,
        max_total_tokens=4096,
        mamba_radix_cache_strategy="no_buffer",
        disable_overlap_schedule=True,
    ) as eng:
        idle = settled_snapshot(registry, "bench-mamba", lambda s: s.used_blocks == 0)
        slots = idle.total_blocks - 1
        print(
            f"state slots {slots}, cell {idle.block_size_bytes} B, reserved {slots * idle.block_size_bytes} B"
        )
        print(f"page {idle.page_bytes} B ({idle.blocks_per_page} slots); idle mapped {idle.mapped_bytes} B")
        _, peak = generate_watching_peaks(eng, registry, ("bench-mamba",), BATCH, max_new_tokens=16)
        print(f"peak mapped with {len(BATCH)} requests: {peak['bench-mamba']} B")
        while not eng.call("flush_cache").success:  # SGLang flushes only an idle scheduler
            time.sleep(0.2)
        after = settled_snapshot(registry, "bench-mamba", lambda s: s.used_blocks == 0)
        print(f"after flush_cache mapped {after.mapped_bytes} B")


if __name__ == "__main__":
    main()
