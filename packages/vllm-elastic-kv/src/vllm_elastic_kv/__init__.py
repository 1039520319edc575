"""vllm-elastic-kv: an elastic KV cache for vLLM.

``pip install vllm-elastic-kv`` registers :func:`register` in vLLM's ``vllm.general_plugins`` entry-point
group; ``vllm serve MODEL --kv-cache-backend=elastic`` (or ``LLM(..., additional_config={"kv_cache_backend":
"elastic"})``, or ``ELASTIC_KV_BACKEND=elastic``) then runs the engine with a KV cache whose physical memory
follows load. See ``docs/ARCHITECTURE.md`` (section "vLLM") for how the plugin hooks into vLLM.

The subpackages follow the vLLM process that runs their code: :mod:`.frontend` (the process the user
starts: argument parsing, activation), :mod:`.scheduler` (the engine core: scheduler, KV cache manager,
block pool) and :mod:`.worker` (each worker process: the KV cache's memory). The modules beside them serve
every process: :mod:`.config` (the settings), :mod:`.compat` (the vLLM members relied on), :mod:`.features`
(the model features served) and :mod:`.layout` (the pool's geometry, planned by the scheduler and checked
by the workers).
"""

from __future__ import annotations

import contextlib
import logging
import os
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

__all__ = ["SLEEP_BACKEND", "__version__", "register"]

# The name of the sleep-mode backend that keeps asleep weights in the host arena
# (vllm_elastic_kv.worker.sleep).
SLEEP_BACKEND = "elastic"

try:  # the repository's one VERSION file, through the installed distribution's metadata
    __version__ = _version("vllm-elastic-kv")
except PackageNotFoundError:  # imported from a source folder that was never installed
    __version__ = "0+unknown"

logger = logging.getLogger(__name__)


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; vLLM calls it in every process it starts.

    It only wraps vLLM's three front-end entry points (``EngineArgs.add_cli_args``, ``from_cli_args``,
    ``create_engine_config``) so that ``--kv-cache-backend`` exists and ``kv_cache_backend=elastic`` can be
    turned into vLLM's official ``--scheduler-cls`` / ``--worker-cls`` settings. With the native backend
    those wrappers return exactly what vLLM returns; nothing on the engine side is touched. Safe to call
    any number of times (each wrapper is installed once).

    Where a host arena is configured (``ELASTIC_KV_HOST_ARENA``, set by ``elastic-kv serve``), it also makes
    the ``elastic`` sleep-mode backend known to vLLM's sleep-mode factory, by name only: vLLM imports
    :mod:`vllm_elastic_kv.worker.sleep` once an engine that the plugin activated selects it.
    """
    # Imported here: vLLM may load plugins while its own modules are still importing.
    from elastic_kv.host import ENV_HOST_ARENA

    from vllm_elastic_kv import compat
    from vllm_elastic_kv.frontend import activation, cli

    for patch in (*cli.patches(), activation.patch()):
        compat.apply_patch(patch)
    if os.environ.get(ENV_HOST_ARENA):
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

        with contextlib.suppress(ValueError):  # registered by an earlier call in this process
            SleepModeBackendFactory.register_backend(
                SLEEP_BACKEND, "vllm_elastic_kv.worker.sleep", "ElasticSleepBackend"
            )
