"""Who may use the server: API keys, and the refusal to serve the network without one.

Keys come from ``[server] api_keys`` (a string, or ``{ key = "...", models = [...] }`` for a key limited to
some models), from ``api_key_file`` (one key per line; blank lines and lines starting with ``#`` are
skipped), from the environment variable ``ELASTIC_KV_API_KEY`` and from ``--api-key``. Clients send one the
way OpenAI clients do, ``Authorization: Bearer <key>``. When any key is configured, every route needs one
but ``/health`` and ``/ready`` (the probes) and ``/metrics`` (for scrapers and routers, as vLLM's server
has it; with ``public_metrics = false`` it needs a key too): without a valid key the answer is 401. Keys are
compared in constant time, each presented key against every configured key, so the answer's timing tells
nothing about which key nearly matched. A key limited to some models sees only those: others are 404, as an
unknown model is, and ``/v1/models`` lists only its own.

A server that listens beyond loopback without a key would let anyone who can reach its port use every
model and make engines start: :func:`check_exposure` refuses that, unless ``allow_unauthenticated`` says
the operator means it (a network policy or a gateway in front does the authentication).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from elastic_kv.errors import ConfigError

from elastic_kv_serve.config import ServerConfig

__all__ = ["ENV_KEY", "ApiKey", "Keys", "check_exposure", "load_keys", "open_paths"]

ENV_KEY = "ELASTIC_KV_API_KEY"


def open_paths(server: ServerConfig) -> frozenset[str]:
    """The routes that answer without a key: the probes, and ``/metrics`` unless ``public_metrics`` is off."""
    return frozenset({"/health", "/ready", *(["/metrics"] if server.public_metrics else [])})


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One configured key; ``models`` is ``None`` for a key to every model."""

    secret: bytes
    models: frozenset[str] | None = None

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


class Keys:
    """The server's keys (none: the server is open)."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self._keys = keys

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, authorization: str | None) -> ApiKey | None:
        """The key an ``Authorization`` header presents, or ``None`` (missing, malformed or unknown). Every
        configured key is compared, whatever matched first."""
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            return None
        given = presented.strip().encode()
        found = None
        for key in self._keys:
            if hmac.compare_digest(given, key.secret) and found is None:
                found = key
        return found


def load_keys(
    server: ServerConfig, environ: Mapping[str, str] | None = None, extra: Iterable[str] = ()
) -> Keys:
    """Every key of the config, its key file, the environment and ``extra`` (``--api-key``);
    :class:`ConfigError` (one line) for a key file that cannot be read or holds no key, or an empty key."""
    env = os.environ if environ is None else environ
    keys = [
        ApiKey(e.key.encode(), None if e.models is None else frozenset(e.models)) for e in server.api_keys
    ]
    if server.api_key_file is not None:
        try:
            lines = server.api_key_file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"server.api_key_file: cannot read {server.api_key_file}: {exc}") from None
        found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not found:
            raise ConfigError(f"server.api_key_file: {server.api_key_file} holds no key")
        keys += [ApiKey(k.encode()) for k in found]
    if env.get(ENV_KEY, "").strip():
        keys.append(ApiKey(env[ENV_KEY].strip().encode()))
    for key in extra:
        if not key.strip():
            raise ConfigError("--api-key: an API key cannot be empty")
        keys.append(ApiKey(key.strip().encode()))
    return Keys(keys)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve beyond loopback


def check_exposure(server: ServerConfig, keys: Keys) -> None:
    """:class:`ConfigError` for a server that would listen beyond loopback with no key, unless
    ``allow_unauthenticated`` is set."""
    if keys.enabled or server.allow_unauthenticated or _is_loopback(server.host):
        return
    raise ConfigError(
        f"server.host: {server.host} is reachable beyond this machine and no API key is configured: set "
        f"api_keys, api_key_file or {ENV_KEY} (or allow_unauthenticated = true if a gateway in front checks "
        "keys)"
    )
