"""Fixtures of the ranks suite: one cluster of rank processes per transport kind and module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ranks_harness import Cluster

WORLD = 3  # e.g. TP=3, or one more rank than a TP=2 x PP=1 group: enough for "some succeeded, one failed"


@pytest.fixture(scope="module", params=["inproc", "socket", "rpc"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(request.param, WORLD)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def pool(cluster: Cluster) -> Iterator[int]:
    """A fresh pool on every rank; afterwards dead ranks are respawned and scripts cleared."""
    pool = cluster.new_pool()
    try:
        yield pool
    finally:
        cluster.revive()
        cluster.reset_scripts()
