"""The ledger over the CUDA backend (GPU machine only: ``python -m pytest -m gpu tests/ledger``).

Real 2 MiB VMM pages under torch tensors: every block the ledger issues is written by a CUDA kernel and
read back before it is freed; pages are unmapped only after the epoch of the kernels that touched them
was released (the engine protocol of ``defer_release``), and the charge always equals what the driver
backs.
"""

from __future__ import annotations

import random

import pytest
from elastic_kv import _vmm
from elastic_kv.config import ElasticConfig
from elastic_kv.geometry import BlockGeometry
from elastic_kv.ledger import Ledger
from elastic_kv.ledger.page_mapper import LocalMapper

MIB = 1 << 20
KIB = 1 << 10

pytestmark = pytest.mark.gpu


def test_ledger_drives_cuda_pages_with_deferred_release() -> None:
    torch = pytest.importorskip("torch")
    backend = _vmm.CudaBackend(0)
    # 4 layers, layer-outer, 96 KiB blocks (not a power of two: 64 blocks = 3 slots, compound pages)
    num_blocks, block = 512, 96 * KIB
    geo = BlockGeometry.from_layer_strides(
        4 * num_blocks * block, num_blocks, 4, num_blocks * block, block, block, 2 * MIB
    )
    mapper = LocalMapper.for_geometry(backend, geo, cached_bytes=64 * MIB)
    cfg = ElasticConfig(page_size=2 * MIB, defer_release=True, reserve_min_pages=1, reserve_max_pages=4)
    led = Ledger(geo, mapper, cfg)
    (space,) = mapper.group.spaces
    kv = torch.from_dlpack(space)
    assert kv.is_cuda
    rng = random.Random(0)
    held: dict[int, int] = {}  # block -> the byte value written into it
    try:
        for step in range(300):
            epoch = led.advance_epoch()
            for _ in range(rng.randint(0, 3)):
                got = led.alloc(rng.choice([1, 1, 2, 8, 40]))
                if got is None:
                    continue
                for b in got:
                    value = rng.randrange(1, 255)
                    for _, lo, hi in geo.block_ranges(b):
                        kv[lo:hi].fill_(value)  # a kernel on the (not yet synchronised) stream
                    held[b] = value
            if held and rng.random() < 0.5:
                gone = rng.sample(sorted(held), min(len(held), rng.randint(1, 40)))
                for b in gone:
                    for _, lo, hi in geo.block_ranges(b):
                        assert int(kv[lo:hi].min()) == int(kv[lo:hi].max()) == held[b], f"block {b} lost data"
                led.free(gone)  # the fills above may still be queued: unmapping must wait for the epoch
                for b in gone:
                    del held[b]
            torch.cuda.synchronize()  # the step's GPU work finished ...
            led.release_through(epoch)  # ... so its emptied pages may be unmapped
            led.maintain()
            if step % 25 == 0:
                led.settle()
                led.check_invariants()
                assert set(led.mapped_pages()) == set(mapper.group.mapped_pages())
                assert led.charged_bytes == mapper.group.mapped_bytes
        led.free(sorted(held))
        torch.cuda.synchronize()
        led.release_through(led.advance_epoch())
        led.settle()
        led.trim()
        assert mapper.group.mapped_pages() == [0]  # only the null block's page stays backed
    finally:
        led.close()
        mapper.close()
    assert backend.cleanup_failures == 0


def test_device_key_is_the_gpu_uuid_for_every_process_view() -> None:
    """``device_key`` names a GPU by the UUID ``nvidia-smi -L`` shows, read from the driver without a
    context, and the size is the driver's: the same for every engine and rank on that GPU."""
    import subprocess

    from elastic_kv.device import device_key, device_total_bytes

    torch = pytest.importorskip("torch")
    key = device_key("cuda", 0)
    props = torch.cuda.get_device_properties(0)
    assert key == f"GPU-{props.uuid}"
    assert device_total_bytes("cuda", 0) == props.total_memory
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    assert key in listed
