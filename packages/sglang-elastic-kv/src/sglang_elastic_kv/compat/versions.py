"""The SGLang versions the plugin serves and, for each, its hook targets: :data:`SEAMS`, :class:`Seams`.

Each supported version is in one :class:`Seams` row, which names the dotted hook targets (``HookRegistry``
paths) of the versions it serves and how they were verified:

* *engine-verified* (``verified="engine"``): the engine tests (``tests/sglang``) ran end to end on it;
* *source-verified* (``verified="source"``): no engine ran on it, but every hook target (with the leading
  parameters its hook reads, :data:`HOOK_PARAMS`), member and instance member the plugin relies on matches
  the release's source (``ci/sglang_compat_check.py``, run for each supported version by
  ``tests/sglang/test_sglang_compat_source.py``).

The rule applied at start-up (:func:`sglang_elastic_kv.compat.select`) is the vLLM plugin's: an
engine-verified version starts silently, a source-verified one with one warning line, any other version is
refused in one line naming the first symbol that does not match.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from elastic_kv.errors import ConfigError

__all__ = [
    "ALLOC",
    "CLI_TARGETS",
    "CONFIGURATOR",
    "HOOK_PARAMS",
    "PLATFORM",
    "POOLS",
    "SEAMS",
    "STARTUP_GUARD",
    "WEIGHT_UPDATER",
    "Seams",
    "installed_sglang_version",
    "row_for",
    "supported_text",
    "verified_versions",
]


@dataclass(frozen=True)
class Seams:
    """The hook targets for the SGLang versions in ``versions`` (dotted paths for ``HookRegistry``), and
    how those versions were verified (see the module docstring)."""

    versions: tuple[str, ...]
    verified: Literal["engine", "source"]
    # Platform seams: the in-tree platforms (CPU, CUDA, ROCm ...) inherit these from the base class,
    # so one AFTER hook on the base answers for every in-tree platform without choosing the platform.
    kv_pool_cls: str
    paged_allocator_cls: str
    # The allocator builder: page_size 1 builds TokenToKVPoolAllocator without asking the platform.
    allocator_builder: str
    # The configurator's entry point: its result is checked (a path that bypassed the seams fails).
    configure: str
    # Command line: --kv-cache-backend.
    add_cli_args: str
    prepare_server_args: str
    # Radix-cache bound: where a request's KV row is handed to the prefix cache (any tree cache).
    release_kv_cache: str
    # release_memory_occupation / resume_memory_occupation in the scheduler (sleep and wake the pool).
    release_memory: str
    resume_memory: str
    # Fails start-up inside the scheduler when the plugin cannot serve (a stable constructor).
    startup_guard: str
    # The scheduler's constructor: server arguments the plugin refuses are checked before any worker.
    scheduler_init: str
    # The builder of a Mamba / linear hybrid's request pool (its conv and SSM state pool).
    hybrid_req_pool_builder: str
    # Decode retraction: the requests retracted are counted as the pool's preemptions.
    retract_decode: str
    # Where the scheduler produces its own aborts (timeouts): requests that can never fit are added.
    poll_aborts: str
    # The scheduler's pass without a batch: a scheduler waiting for memory sleeps there as when idle.
    on_idle: str

    @property
    def label(self) -> str:
        """``"0.5.23"`` (or ``"0.5.23, 0.5.24"``) for messages."""
        return ", ".join(self.versions)

    def targets(self) -> tuple[str, ...]:
        """Every dotted target of this row."""
        return tuple(getattr(self, field) for field in HOOK_PARAMS)

    def hooked(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(dotted target, the leading parameters its hook reads) for every target of this row."""
        return tuple((getattr(self, field), params) for field, params in HOOK_PARAMS.items())


# Seams field -> the leading parameters of its target (``self`` included), in order, that the plugin's hook
# reads by position (sglang_elastic_kv.hooks, cli, plugin): a target whose parameters start otherwise does
# not match the row.
HOOK_PARAMS: Mapping[str, tuple[str, ...]] = {
    "kv_pool_cls": ("self", "kind"),
    "paged_allocator_cls": ("self",),
    "allocator_builder": ("self",),
    "configure": ("self",),
    "add_cli_args": ("parser",),
    "prepare_server_args": ("argv",),
    "release_kv_cache": ("req", "tree_cache"),
    "release_memory": ("self", "recv_req"),
    "resume_memory": ("self", "recv_req"),
    "startup_guard": ("self",),
    "scheduler_init": ("self", "server_args"),
    "hybrid_req_pool_builder": ("self",),
    "retract_decode": ("self",),
    "poll_aborts": ("self",),
    "on_idle": ("self",),
}


# Dotted prefixes shared by the hook targets below and the member tables (:mod:`.members`).
PLATFORM = "sglang.srt.platforms.interface.SRTPlatform"
CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
WEIGHT_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
POOLS = "sglang.srt.mem_cache.memory_pool"
ALLOC = "sglang.srt.mem_cache.allocator"

SEAMS: tuple[Seams, ...] = (
    Seams(
        versions=("0.5.23",),
        verified="engine",
        kv_pool_cls=f"{PLATFORM}.get_kv_pool_cls",
        paged_allocator_cls=f"{PLATFORM}.get_paged_allocator_cls",
        allocator_builder=f"{CONFIGURATOR}._build_token_to_kv_pool_allocator",
        configure=f"{CONFIGURATOR}.configure",
        add_cli_args="sglang.srt.server_args.ServerArgs.add_cli_args",
        prepare_server_args="sglang.srt.server_args.prepare_server_args",
        release_kv_cache="sglang.srt.mem_cache.common.release_kv_cache",
        release_memory=f"{WEIGHT_UPDATER}.release_memory_occupation",
        resume_memory=f"{WEIGHT_UPDATER}.resume_memory_occupation",
        startup_guard=f"{POOLS}.KVCache.__init__",
        scheduler_init="sglang.srt.managers.scheduler.Scheduler.__init__",
        hybrid_req_pool_builder=f"{CONFIGURATOR}._build_hybrid_req_pool",
        retract_decode="sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode",
        poll_aborts="sglang.srt.managers.scheduler.Scheduler._poll_timeout_aborts",
        on_idle="sglang.srt.managers.scheduler.Scheduler.on_idle",
    ),
)

# The command-line hooks exist since the plugin loader (0.5.12); they are the only hooks installed
# when the plugin is not enabled, and they must work on versions the memory hooks do not support so
# that --kv-cache-backend=elastic can report the unsupported version instead of "unknown argument".
CLI_TARGETS = ("sglang.srt.server_args.ServerArgs.add_cli_args", "sglang.srt.server_args.prepare_server_args")
STARTUP_GUARD = f"{POOLS}.KVCache.__init__"


def installed_sglang_version() -> str:
    """The installed SGLang distribution's version (no import of sglang); ConfigError if absent."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError("the SGLang plugin is enabled but sglang is not installed") from None


def verified_versions(kind: Literal["engine", "source"]) -> list[str]:
    """The versions of every row verified by ``kind``."""
    return [version for row in SEAMS if row.verified == kind for version in row.versions]


def supported_text() -> str:
    """``"engine-verified 0.5.23"`` (``"...; source-verified 0.5.24"`` when there are such) for messages."""
    parts = [
        f"{kind}-verified {', '.join(verified_versions(kind))}"
        for kind in ("engine", "source")
        if verified_versions(kind)
    ]
    return "; ".join(parts)


def _release(version: str) -> tuple[int, ...]:
    """``"0.5.23.post1"`` -> ``(0, 5, 23)``: the release number, for ordering (``()`` when there is none)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def row_for(version: str) -> Seams:
    """The row serving SGLang ``version``; for a version without one, the row of the newest supported version
    at or below its release number (what it is checked against), else the oldest row."""
    version = version.strip()
    for row in SEAMS:
        if version in row.versions:
            return row
    ordered = sorted(((_release(v), row) for row in SEAMS for v in row.versions), key=lambda pair: pair[0])
    below = [row for release, row in ordered if release <= _release(version)]
    return below[-1] if below else ordered[0][1]
