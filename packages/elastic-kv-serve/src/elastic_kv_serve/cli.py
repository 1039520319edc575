"""``elastic-kv``: serve many models behind one OpenAI endpoint, and show what the server is doing.

    elastic-kv serve --config models.toml [--host H] [--port P] [--api-key KEY ...]
                     [--ssl-certfile CRT --ssl-keyfile KEY]
    elastic-kv serve --model NAME=PATH [--model NAME2=PATH2 ...] [--engine vllm|sglang] [--budget 80%]
    elastic-kv status [--url http://127.0.0.1:8000] [--json] [--api-key KEY] [--cacert CA.pem]

A bad config stops ``serve`` before anything starts, with one line naming the key (exit status 2). SIGTERM
or SIGINT drains the server: it stops accepting, lets in-flight requests finish (``drain_timeout_s``), then
stops every engine and removes their pool records; then it exits by that signal (uvicorn re-raises it, so
a supervisor sees how it ended).
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_kv.errors import ConfigError
from elastic_kv.sizes import format_bytes

__all__ = ["main", "render_status"]

logger = logging.getLogger("elastic_kv_serve")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-kv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the models of a config (or of --model flags)")
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="a TOML config ([server], [[models]])")
    source.add_argument("--model", action="append", metavar="NAME=PATH", help="a model to serve (repeatable)")
    serve.add_argument(
        "--engine", choices=("vllm", "sglang"), default="vllm", help="engine of --model models"
    )
    serve.add_argument("--host", help="listen address (overrides [server] host)")
    serve.add_argument("--port", type=int, help="listen port (overrides [server] port)")
    serve.add_argument("--api-key", action="append", help="an API key clients must send (repeatable)")
    serve.add_argument("--api-key-file", help="a file of API keys, one per line")
    serve.add_argument(
        "--allow-unauthenticated", action="store_true", help="listen beyond loopback without an API key"
    )
    serve.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (with --ssl-keyfile)")
    serve.add_argument("--ssl-keyfile", help="the certificate's private key")
    serve.add_argument("--budget", help="--model form: device budget, e.g. 80%% or 100G")
    serve.add_argument("--idle-sleep-s", type=float, help="--model form: idle seconds before a model sleeps")
    serve.add_argument("--registry-dir", help="--model form: the pool registry directory")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    status = sub.add_parser("status", help="the state of every model of a running server")
    status.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    status.add_argument("--json", action="store_true", help="the raw /status document")
    status.add_argument("--api-key", help="the server's API key (default: $ELASTIC_KV_API_KEY)")
    status.add_argument("--cacert", help="CA certificate to verify an https:// server with")
    return parser


def _load(args: argparse.Namespace) -> Any:
    from elastic_kv_serve.config import load_config, quick_config

    names = ("host", "port", "api_key_file", "ssl_certfile", "ssl_keyfile")
    server: dict[str, Any] = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.allow_unauthenticated:
        server["allow_unauthenticated"] = True
    if args.config is not None:
        config = load_config(args.config, server)
    else:
        for key in ("budget", "idle_sleep_s", "registry_dir"):
            if getattr(args, key) is not None:
                server[key] = getattr(args, key)
        config = quick_config(args.model, args.engine, server)
    return config


def _listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now so that a port in use stops the server before anything
    starts; :class:`ConfigError` (one line) when it cannot be bound."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"server.host: cannot listen on {host}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"server.port: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _check_tls(srv: Any) -> None:
    """:class:`ConfigError` (one line) when the certificate and key cannot serve TLS."""
    import ssl

    if srv.ssl_certfile is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(srv.ssl_certfile, srv.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"server.ssl_certfile: cannot serve TLS with {srv.ssl_certfile} and {srv.ssl_keyfile}: {exc}"
        ) from None


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from elastic_kv_serve.auth import check_exposure, load_keys
    from elastic_kv_serve.config import check_model_paths
    from elastic_kv_serve.engines import EngineStartError
    from elastic_kv_serve.router import create_app
    from elastic_kv_serve.supervisor import Supervisor

    config = _load(args)
    check_model_paths(config)
    keys = load_keys(config.server, extra=args.api_key or ())
    check_exposure(config.server, keys)
    _check_tls(config.server)
    sock = _listen(config.server.host, config.server.port)
    supervisor = Supervisor(config)
    try:
        supervisor.prepare()
    except EngineStartError as exc:
        sock.close()
        raise ConfigError(str(exc)) from None
    except BaseException:
        sock.close()
        raise
    app = create_app(config, supervisor, keys)
    srv = config.server
    scheme = "https" if srv.ssl_certfile is not None else "http"
    logger.info(
        "serving %d model(s) on %s://%s:%d (%s)", len(config.models), scheme, srv.host, srv.port,
        f"{len(keys)} API key(s)" if keys.enabled else "no API key",
    )  # fmt: skip
    uv = uvicorn.Server(
        uvicorn.Config(
            app,
            host=srv.host,
            port=srv.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=int(srv.drain_timeout_s) or None,
            ssl_certfile=srv.ssl_certfile,
            ssl_keyfile=srv.ssl_keyfile,
            lifespan="on",
            access_log=args.log_level == "debug",
        )
    )
    uv.run(sockets=[sock])
    return 0 if uv.started else 1


def render_status(doc: dict[str, Any]) -> str:
    """The ``elastic-kv status`` table of a ``/status`` document."""
    header = ["MODEL", "ENGINE", "STATE", "SLEEP", "PID", "WEIGHTS", "KV", "IN FLIGHT", "QUEUED", "WAKES",
              "WAKE P50", "WAKE P99", "LAST USED"]  # fmt: skip
    rows = []
    for m in doc["models"]:

        def secs(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}s"

        last = "-" if m["last_used"] is None else _ago(m["last_used"])
        rows.append(
            [m["name"], m["engine"], "suspended" if m["suspended"] else m["state"], m["sleep_mode"],
             str(m["pid"] or "-"),
             format_bytes(m["weights_bytes"]), format_bytes(m["kv_bytes"]), str(m["in_flight"]),
             str(m["queued"]), str(m["wakes"]), secs(m["wake_p50_s"]), secs(m["wake_p99_s"]), last]
        )  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]
    budget = doc["budget_bytes"]
    lines.append(
        f"budget {format_bytes(budget) if budget else 'none'}, used {format_bytes(doc['used_bytes'])} "
        f"(awake weights + KV); registry {doc['registry_dir']}"
    )
    for m in doc["models"]:
        if m["error"]:
            lines.append(f"{m['name']}: {m['error']}")
    return "\n".join(lines)


def _ago(wall: float) -> str:
    import time

    return f"{max(0.0, time.time() - wall):.0f}s ago"


def _status(args: argparse.Namespace) -> int:
    import os
    import ssl

    import httpx

    from elastic_kv_serve.auth import ENV_KEY

    key = args.api_key or os.environ.get(ENV_KEY)
    headers = {"authorization": f"Bearer {key}"} if key else None
    try:
        verify: Any = ssl.create_default_context(cafile=args.cacert) if args.cacert else True
    except (OSError, ssl.SSLError) as exc:
        print(f"elastic-kv status: --cacert {args.cacert}: {exc}", file=sys.stderr)
        return 2
    try:
        reply = httpx.get(f"{args.url.rstrip('/')}/status", timeout=10, headers=headers, verify=verify)
        reply.raise_for_status()
    except httpx.HTTPError as exc:
        print(f"elastic-kv status: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    doc = reply.json()
    print(json.dumps(doc, indent=2) if args.json else render_status(doc))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        logging.basicConfig(
            level=getattr(logging, args.log_level.upper()),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        logging.getLogger("httpx").setLevel(logging.WARNING)
        try:
            return _serve(args)
        except ConfigError as exc:
            print(f"elastic-kv: error: {exc}", file=sys.stderr)
            return 2
    return _status(args)


if __name__ == "__main__":
    sys.exit(main())
