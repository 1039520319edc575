"""The ranks protocol on GPUs: one rank process per GPU (CudaBackend(device=rank)), Unix-socket transport.

Needs a machine with >= 2 CUDA GPUs with VMM support; skipped elsewhere (marker ``gpu``). Run:

    python -m pytest tests/ranks/test_ranks_gpu.py -m gpu -q
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest
from elastic_kv import _vmm
from elastic_kv.errors import PoolExhausted, StateConsistencyError
from elastic_kv.ranks.messages import Op
from ranks_harness import Cluster

pytestmark = pytest.mark.gpu


def _gpu_count() -> int:
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if _gpu_count() < 2:
        pytest.skip("needs two GPUs")
    c = Cluster("socket", 2, device="cuda")
    try:
        yield c
    finally:
        c.close()


def test_map_unmap_on_two_gpus(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool, timeout=30.0)
    c.map(list(range(8)))
    cluster.assert_agree(pool, list(range(8)))
    c.unmap([1, 3, 5])
    cluster.assert_agree(pool, [0, 2, 4, 6, 7])
    c.unmap([0, 2, 4, 6, 7])
    cluster.assert_agree(pool, [])


def test_oom_on_one_gpu_rolls_back_the_other(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool, timeout=30.0)
    c.map([0])
    cluster.ctl(1, "fail", pool, "create", 2, 1, "oom")
    with pytest.raises(PoolExhausted):
        c.map([1, 2, 3])
    cluster.assert_agree(pool, [0])


def test_failed_prepare_is_aborted_on_the_other_gpu(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool, timeout=30.0)
    c.map([4, 5])
    cluster.ctl(0, "fail", pool, "unmap", 1, 1, "error")
    with pytest.raises(_vmm.BackendError, match="rolled back on every rank"):
        c.unmap([4, 5])
    cluster.assert_agree(pool, [4, 5])


def test_gpu_rank_dies_after_prepare(cluster: Cluster, pool: int) -> None:
    c = cluster.coordinator(pool, timeout=30.0)
    c.map([1, 2])
    cluster.ctl(1, "script", int(Op.PREPARE), "die_after")
    with pytest.raises(StateConsistencyError, match="rank 1 gone"):
        c.unmap([1])
    cluster.wait_dead(1)
    live, empty = cluster.ctl(0, "drop_pool", pool)  # rank 0 restored, and gives everything back
    assert live == empty
