"""The backend-independent behaviour suite, re-run on the CUDA backend (ci/gpu.sh runs `pytest -m gpu`).

Every test imported below takes its backend from the `make_backend` fixture; overriding `backend_kind` here
makes them build CudaBackend(0) instead of the host backend, and their torch views become CUDA tensors (DLPack
device kDLCUDA). Tests that need a physical budget of ours skip themselves on CUDA (see conftest.py).
"""

from __future__ import annotations

import pytest
from test_bad_inputs import *  # noqa: F403
from test_group import *  # noqa: F403
from test_pool import *  # noqa: F403
from test_prefetch import test_map_async_maps_in_the_background  # noqa: F401
from test_space import *  # noqa: F403
from test_transactions import *  # noqa: F403

pytestmark = pytest.mark.gpu


@pytest.fixture
def backend_kind() -> str:
    return "cuda"
