"""How much GPU memory a vLLM engine takes beyond its KV cache during a burst (GPU machine only).

This is the number ``ELASTIC_KV_MIN_FREE`` must leave free on a GPU shared by engines whose KV caches grow
into the same memory (``elastic_kv.device.default_min_free_bytes`` is the default it checks). One elastic
engine runs a burst while a thread samples, every 5 ms, the GPU's used memory (NVML: every process) and
the KV bytes the pool's records charge on that device (the registry). Their difference is what the engine
holds outside its KV cache: weights, activations, workspaces, graph pools. The script prints, as one JSON
line, that difference when idle before the burst, its peak during the burst, and the growth (peak - idle):
the memory a burst needs beyond its KV. Nothing else may run on the GPU meanwhile.

    python ci/gpu_headroom.py --model DIR [--load-format dummy] [--requests 256 --prompt 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _used_bytes(key: str) -> int:
    import pynvml

    handle = pynvml.nvmlDeviceGetHandleByUUID(key)
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--load-format", default="auto", help="dummy: random weights (a config-only folder)")
    args = parser.parse_args()

    registry_dir = tempfile.mkdtemp(prefix="ekv-headroom-")
    os.environ["ELASTIC_KV_REGISTRY_DIR"] = registry_dir
    os.environ["ELASTIC_KV_MIN_FREE"] = "0"  # measure without the headroom this is meant to size

    import pynvml
    from elastic_kv.device import device_key
    from elastic_kv.registry import Registry
    from vllm import LLM, SamplingParams

    pynvml.nvmlInit()
    llm = LLM(
        model=args.model,
        gpu_memory_utilization=args.gpu_memory_utilization,
        load_format=args.load_format,
        additional_config={"kv_cache_backend": "elastic", "elastic_kv": {"pool_name": "headroom"}},
    )
    # After the engine starts: device_key initialises the CUDA driver in this process, and vLLM forks its
    # engine core when torch has not initialised CUDA, so an earlier call leaves the child without a driver.
    key = device_key("cuda", 0)
    registry = Registry(Path(registry_dir))

    def outside_kv() -> int:
        (device,) = [d for d in registry.devices(reclaim=False) if d.device == key]
        return _used_bytes(key) - device.charged_bytes

    time.sleep(2.0)
    idle = outside_kv()
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(outside_kv())
            stop.wait(0.005)

    prompts: list[Any] = [
        {"prompt_token_ids": [(r * 7919 + t * 104729) % 30000 + 100 for t in range(args.prompt)]}
        for r in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    start = time.monotonic()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.monotonic() - start
    stop.set()
    watcher.join()
    peak = max(samples)
    print(
        json.dumps(
            {
                "device": key,
                "model": args.model,
                "requests": args.requests,
                "prompt": args.prompt,
                "output": args.output,
                "burst_s": round(seconds, 2),
                "samples": len(samples),
                "outside_kv_idle_bytes": idle,
                "outside_kv_peak_bytes": peak,
                "burst_growth_bytes": peak - idle,
                "burst_growth_gib": round((peak - idle) / 2**30, 3),
            }
        )
    )
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
