"""Which SGLang versions the plugin supports, and through which seams: one table, nothing else.

Every version-specific fact lives here. A :class:`Seams` row names the dotted targets the plugin hooks
for a range of SGLang versions; :func:`select` picks the row for the installed version or raises
:class:`~elastic_kv.errors.ConfigError` with the reason. ``tests/sglang/test_compat.py`` resolves every
target of the installed version's row, so a target that moves upstream fails loudly in CI.

0.5.22 and 0.5.23 consult the platform for the pool class (``get_kv_pool_cls(kind=...)``) and the
paged allocator class (``get_paged_allocator_cls()``) on every platform, in-tree ones included; the
one construction site they miss is page_size 1, which builds ``TokenToKVPoolAllocator`` directly
(the configurator and the SWA allocator's sub-allocators), so the allocator builder is wrapped once.
0.5.20 and 0.5.21 (both read) consult those platform hooks only for out-of-tree platforms and pick
``MHATokenToKVPool`` by name inside a configurator method: serving them would mean hooking the in-tree
pool's buffer creation for every instance of a class that has siblings, which this plugin does not do
(no small, clean compat entry exists), so they get a clear start-up error. Before 0.5.12 SGLang has no
plugin loader: the plugin never runs and ``--kv-cache-backend`` is an unknown argument.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass

from elastic_kv.errors import ConfigError

__all__ = ["SEAMS", "Seams", "installed_sglang_version", "parse_version", "select"]

Version = tuple[int, int, int]


@dataclass(frozen=True)
class Seams:
    """The hook targets for SGLang versions ``first <= v < end`` (dotted paths for ``HookRegistry``)."""

    first: Version
    end: Version
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

    def targets(self) -> tuple[str, ...]:
        """Every dotted target of this row (for the test that resolves them)."""
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
        )


_PLATFORM = "sglang.srt.platforms.interface.SRTPlatform"
_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_WEIGHT_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"

SEAMS: tuple[Seams, ...] = (
    Seams(
        first=(0, 5, 22),
        end=(0, 6, 0),
        kv_pool_cls=f"{_PLATFORM}.get_kv_pool_cls",
        paged_allocator_cls=f"{_PLATFORM}.get_paged_allocator_cls",
        allocator_builder=f"{_CONFIGURATOR}._build_token_to_kv_pool_allocator",
        configure=f"{_CONFIGURATOR}.configure",
        add_cli_args="sglang.srt.server_args.ServerArgs.add_cli_args",
        prepare_server_args="sglang.srt.server_args.prepare_server_args",
        release_kv_cache="sglang.srt.mem_cache.common.release_kv_cache",
        release_memory=f"{_WEIGHT_UPDATER}.release_memory_occupation",
        resume_memory=f"{_WEIGHT_UPDATER}.resume_memory_occupation",
        startup_guard="sglang.srt.mem_cache.memory_pool.KVCache.__init__",
    ),
)

# The command-line hooks exist since the plugin loader (0.5.12); they are the only hooks installed
# when the plugin is not enabled, and they must work on versions the memory hooks do not support so
# that --kv-cache-backend=elastic can report the unsupported version instead of "unknown argument".
CLI_TARGETS = ("sglang.srt.server_args.ServerArgs.add_cli_args", "sglang.srt.server_args.prepare_server_args")
STARTUP_GUARD = "sglang.srt.mem_cache.memory_pool.KVCache.__init__"


def parse_version(text: str) -> Version:
    """``"0.5.23"``, ``"0.5.23.post1"``, ``"0.5.24rc0"`` -> ``(0, 5, 23|24)``; ValueError otherwise."""
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def installed_sglang_version() -> str:
    """The installed SGLang distribution's version (no import of sglang); ConfigError if absent."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError("the SGLang plugin is enabled but sglang is not installed") from None


def select(version: str) -> Seams:
    """The :class:`Seams` row serving SGLang ``version``; ConfigError naming the supported range otherwise."""
    parsed = parse_version(version)
    for row in SEAMS:
        if row.first <= parsed < row.end:
            return row
    supported = ", ".join(f">={'.'.join(map(str, r.first))},<{'.'.join(map(str, r.end))}" for r in SEAMS)
    if parsed < SEAMS[0].first:
        why = (
            "it builds its KV pools without consulting the platform's pool and allocator seams "
            "(get_kv_pool_cls / get_paged_allocator_cls) on in-tree platforms"
        )
    else:
        why = "this plugin has not been verified against it"
    raise ConfigError(
        f"--kv-cache-backend=elastic does not support sglang {version}: {why}. Supported: {supported}. "
        f"Install a supported sglang or run with --kv-cache-backend=native."
    )
