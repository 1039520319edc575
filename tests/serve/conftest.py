"""The ``elastic-kv serve`` tests need the ``elastic-kv-serve`` package; where it is not installed (a GPU
machine running only the data-plane groups of ``ci/gpu.sh``) they are not collected."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("elastic_kv_serve") is not None else ["test_*.py"]
