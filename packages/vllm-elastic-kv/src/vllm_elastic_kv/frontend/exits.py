"""What an engine's processes leave behind when vLLM stops them without a grace period.

``vllm serve`` stopped by SIGTERM or SIGINT shuts its engine down in ``abort`` mode with a zero timeout:
the front end sends SIGTERM to the engine core and SIGKILLs it (and its workers) at once, so neither the
pool record (owned by the engine core) nor the ranks' sockets (owned by the workers) are removed by their
owners. The front end outlives them: :func:`clean_up_after_engine`, registered at activation to run at
the front end's exit, waits for those of its child processes that own a pool record to have exited (a
SIGKILLed process with much memory takes a while to die on a loaded machine; other children, such as
multiprocessing's resource tracker, live as long as the front end and are not waited for), then reclaims
the records whose owners are dead (the registry's own liveness rules: a live owner's record is never
touched) and removes the sockets of this engine instance that no process listens on any more.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
import weakref
from pathlib import Path

from elastic_kv.ranks import socket_path
from elastic_kv.registry import Registry, RegistryConfig, reclaim_dead

__all__ = ["clean_up_after_engine", "register_clean_up"]

logger = logging.getLogger(__name__)


def _stale(path: Path) -> bool:
    """True when ``path`` is a socket file no process accepts connections on."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return False


def _wait_for_record_owners(config: RegistryConfig, deadline: float) -> None:
    """Wait until every descendant of this process that owns a pool record has exited (gone or a zombie,
    whose lock the kernel has dropped), or until ``deadline``."""
    import psutil  # vLLM's own dependency: this module runs in vLLM's front end only

    if not config.directory.is_dir():
        return
    owners = {pool.pid for pool in Registry(config.directory).pools(reclaim=False)}
    waiting = [child for child in psutil.Process().children(recursive=True) if child.pid in owners]
    while waiting and time.monotonic() < deadline:
        alive = []
        for child in waiting:
            with contextlib.suppress(psutil.NoSuchProcess):
                if child.status() != psutil.STATUS_ZOMBIE:
                    alive.append(child)
        waiting = alive
        if waiting:
            time.sleep(0.05)


def clean_up_after_engine(
    instance: str, world_size: int, registry_dir: Path | None, wait_s: float = 15.0
) -> None:
    """Remove engine ``instance``'s stale sockets and reclaim dead owners' records (never raises).

    vLLM has just SIGKILLed the engine's processes, which may take seconds to die on a loaded machine: the
    front end's child processes that own a pool record are waited for (up to ``wait_s``) before anything is
    checked, and a socket still accepting after that is polled until the same deadline before it counts as
    another process's. The records are reclaimed last, so that their owners have died too."""
    try:
        deadline = time.monotonic() + wait_s
        config = RegistryConfig(registry_dir) if registry_dir is not None else RegistryConfig.from_env()
        _wait_for_record_owners(config, deadline)
        for rank in range(world_size):
            path = socket_path(instance, rank)
            while path.exists() and not _stale(path) and time.monotonic() < deadline:
                time.sleep(0.05)
            if path.exists() and _stale(path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        if config.directory.is_dir():
            reclaimed = reclaim_dead(config)
            if reclaimed:
                logger.info("elastic KV: removed the records of stopped pools %s", ", ".join(reclaimed))
    except Exception:
        logger.debug("elastic KV: clean-up after the engine failed", exc_info=True)


class _Anchor:
    """Lives as long as the process: the finalizers below run at its exit."""


_ANCHOR = _Anchor()


def register_clean_up(instance: str, world_size: int, registry_dir: Path | None) -> None:
    """Run :func:`clean_up_after_engine` when this (front-end) process exits.

    A finalizer rather than an ``atexit`` function: finalizers left at exit run newest first, so this one
    (made when the engine's config is) runs after the one vLLM's engine client makes when it starts, which
    shuts the engine down in an offline ``LLM`` that was never closed."""
    weakref.finalize(_ANCHOR, clean_up_after_engine, instance, world_size, registry_dir)
