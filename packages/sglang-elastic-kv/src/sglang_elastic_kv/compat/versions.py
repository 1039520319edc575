"""The SGLang versions the plugin serves and, for each, its hook targets: :data:`SUPPORTED`, :class:`Seams`.

Supported versions are the ones whose engine tests ran end to end. Any other version, older or newer,
release or post-release, is refused at start-up with one line that names it and the supported list
(:func:`select`). A :class:`Seams` row names the dotted hook targets (``HookRegistry`` paths) of the
versions it serves.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from elastic_kv.errors import ConfigError

__all__ = [
    "ALLOC",
    "CLI_TARGETS",
    "CONFIGURATOR",
    "PLATFORM",
    "POOLS",
    "SEAMS",
    "STARTUP_GUARD",
    "SUPPORTED",
    "WEIGHT_UPDATER",
    "Seams",
    "installed_sglang_version",
    "select",
    "supported_text",
]

# The SGLang versions whose engine tests (tests/sglang) ran end to end against this plugin.
SUPPORTED: tuple[str, ...] = ("0.5.23",)


@dataclass(frozen=True)
class Seams:
    """The hook targets for the SGLang versions in ``versions`` (dotted paths for ``HookRegistry``)."""

    versions: tuple[str, ...]
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

    def targets(self) -> tuple[str, ...]:
        """Every dotted target of this row."""
        return (
            self.kv_pool_cls,
            self.paged_allocator_cls,
            self.allocator_builder,
            self.configure,
            self.add_cli_args,
            self.prepare_server_args,
            self.release_kv_cache,
            self.release_memory,
            self.resume_memory,
            self.startup_guard,
            self.scheduler_init,
            self.hybrid_req_pool_builder,
            self.retract_decode,
            self.poll_aborts,
            self.on_idle,
        )


# Dotted prefixes shared by the hook targets below and the member tables (:mod:`.members`).
PLATFORM = "sglang.srt.platforms.interface.SRTPlatform"
CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
WEIGHT_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
POOLS = "sglang.srt.mem_cache.memory_pool"
ALLOC = "sglang.srt.mem_cache.allocator"

SEAMS: tuple[Seams, ...] = (
    Seams(
        versions=SUPPORTED,
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


def supported_text() -> str:
    return ", ".join(SUPPORTED)


def select(version: str) -> Seams:
    """The :class:`Seams` row serving SGLang ``version`` (exactly one of :data:`SUPPORTED`); ConfigError
    naming the version and the supported list otherwise."""
    for row in SEAMS:
        if version.strip() in row.versions:
            return row
    raise ConfigError(
        f"--kv-cache-backend=elastic does not support sglang {version}: supported {supported_text()} "
        "(the versions its engine tests ran); install one of them or use --kv-cache-backend=native"
    )
