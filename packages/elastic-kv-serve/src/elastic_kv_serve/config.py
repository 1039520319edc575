"""The server's configuration: a TOML file (the contract) or ``--model NAME=PATH`` flags, validated once.

A config has one ``[server]`` table and one ``[[models]]`` entry per served model::

    [server]
    host = "127.0.0.1"          # where the OpenAI endpoint listens
    port = 8000
    api_keys = ["sk-...", { key = "sk-team", models = ["llama-a"] }]   # clients send one as a bearer token
    api_key_file = "/run/secrets/elastic-kv-keys"   # more keys, one per line (also ELASTIC_KV_API_KEY)
    allow_unauthenticated = false   # needed to listen beyond loopback without a key
    public_metrics = true       # /metrics answers without a key (scrapers, routers); false: it needs one
    ssl_certfile = "/etc/elastic-kv/tls.crt"   # HTTPS (with ssl_keyfile)
    ssl_keyfile = "/etc/elastic-kv/tls.key"
    registry_dir = "/dev/shm/elastic-kv-1000"   # pool records (kvctl); default: elastic-kv's own
    budget = "80%"              # device memory every awake model's weights + KV must fit in ("100G" too)
    device_memory = "80G"       # what "80%" is a share of; default: the device's size as measured
    idle_sleep_s = 300          # default for models that do not set their own; 0 = never
    wake_timeout_s = 300        # a request waits at most this long for its model to wake
    start_timeout_s = 600       # an engine must answer /health within this long after it starts
    drain_timeout_s = 60        # SIGTERM/SIGINT: in-flight requests get this long to finish
    max_request_bytes = "4M"    # larger request bodies are refused with 413
    max_queued = 256            # requests one model may hold waiting (to wake, start, restart); more get 429
    max_in_flight = 0           # requests one model serves at once (0: no limit); more wait in its queue
    max_tokens = 8192           # the most tokens one request may ask for (max_tokens); none by default
    start_parallel = 1          # engines starting at once
    preload = false             # start every model at start-up; those that do not fit awake go to sleep
    kv_headroom = "5%"          # of the budget: while a model serves and less is left, an idle one sleeps
    pressure_idle_s = 2         # ... once it has been idle this long (its own idle_sleep_s aside)
    kv_share_min = "2%"         # of the budget: the least KV share a serving model is cut to (else none)
    kv_share_min_weights = 0    # ... and at least this times the largest weights of the models sharing
    suspend_busy = true         # more models serve than fit: a waking model may suspend a serving one
    min_awake_s = 5             # ... awake at least this long (its requests resume when it wakes again)
    max_suspend_s = 30          # a suspended model waits this long for room, then suspends one awake as long
    host_budget = "40%"         # host memory for asleep models' weights (an arena, filled once, shared)
    host_memory = "128G"        # what "40%" is a share of; default: the host's memory
    host_arena_dir = "/dev/shm" # where the arena file lives (a memory file system); default: registry_dir
    log_dir = "/var/log/elastic-kv"    # engine logs (default: a temporary directory)

    [[models]]
    name = "llama-a"            # the OpenAI `model` name clients send
    engine = "vllm"             # or "sglang"
    model = "/path/or/hub-id"
    args = ["--max-model-len", "4096"]  # passed through to the engine
    env = { OMP_NUM_THREADS = "4" }     # added to the engine's environment
    idle_sleep_s = 300          # 0 = never sleep
    pinned = false              # pinned models never sleep
    priority = 0                # higher keeps memory when the device is full
    max_in_flight = 64          # this model's own limit (default: the server's)
    weights_bytes = "16G"       # the model's weights in memory; default: the checkpoint's weight files

    [[models]]                  # any other OpenAI-compatible server, started by a command of its own
    name = "other"
    engine = "command"
    model = "/path"             # substituted for {model}
    command = ["my-server", "--port", "{port}", "--model", "{model}"]   # {port} is required
    health_path = "/health"     # answers 200 once it serves
    sleep_path = "/sleep?level={level}&mode={mode}"   # optional, with wake_path: sleep through the
    wake_path = "/wake_up?level={level}"  # engine's API (without them, sleeping stops the process);
                                          # {mode} (optional): "keep" (requests in flight resume after
                                          # the wake: the model can be suspended) or "abort"
    demote_path = "/demote"     # optional: turns a level-1 sleep into a level-2 one (its arena extent
                                # given back) so that a model used more recently can sleep at level 1

Unknown keys and bad values raise :class:`~elastic_kv.errors.ConfigError` with one line that names the key
(``models[1].idle_sleep_s: ...``). The tables are pydantic models with ``extra="forbid"`` and strict types.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import tomllib
from elastic_kv.errors import ConfigError
from elastic_kv.sizes import Percent, parse_amount, parse_size
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "KeyConfig",
    "ModelConfig",
    "ServeConfig",
    "ServerConfig",
    "check_model_paths",
    "load_config",
    "parse_config",
    "pool_name_for",
    "quick_config",
    "render_config",
]

_POOL_CHARS = re.compile(r"[^A-Za-z0-9_.:-]")


def _size(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected a size such as 512M or a number of bytes")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size must be >= 0")
        return value
    if isinstance(value, str):
        return parse_size(value)
    raise ValueError("expected a size such as 512M or a number of bytes")


def _amount(value: Any) -> int | Percent:
    if isinstance(value, str):
        amount = parse_amount(value)
        if isinstance(amount, int) and amount <= 0:
            raise ValueError("a budget must be above 0 bytes")
        return amount
    size = _size(value)
    if size <= 0:
        raise ValueError("a budget must be above 0 bytes")
    return size


Size = Annotated[int, BeforeValidator(_size)]
Amount = Annotated[int | Percent, BeforeValidator(_amount)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, arbitrary_types_allowed=True)


_PATH_KEYS = ("registry_dir", "log_dir", "host_arena_dir", "api_key_file", "ssl_certfile", "ssl_keyfile")


class KeyConfig(_Table):
    """An entry of ``api_keys``: a key, and the models it may use (``None``: every model). A plain string in
    the config is a key to every model."""

    key: Annotated[str, Field(min_length=1)]
    models: list[str] | None = None


def _key_entry(value: Any) -> Any:
    if isinstance(value, str):
        return {"key": value}
    if not isinstance(value, dict | KeyConfig):
        raise ValueError('expected a key ("sk-...") or a table { key = "...", models = [...] }')
    return value


class ServerConfig(_Table):
    """The ``[server]`` table (see the module docstring)."""

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    api_keys: list[Annotated[KeyConfig, BeforeValidator(_key_entry)]] = Field(default_factory=list)
    api_key_file: Path | None = None
    allow_unauthenticated: bool = False
    public_metrics: bool = True
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    registry_dir: Path | None = None
    budget: Amount | None = None
    device_memory: Size | None = None
    idle_sleep_s: Seconds = 300.0
    wake_timeout_s: PositiveSeconds = 300.0
    start_timeout_s: PositiveSeconds = 600.0
    drain_timeout_s: Seconds = 60.0
    max_request_bytes: Size = 4 << 20
    restart_backoff_s: PositiveSeconds = 1.0
    restart_backoff_max_s: PositiveSeconds = 30.0
    max_restarts: Annotated[int, Field(ge=0)] = 5
    max_queued: Annotated[int, Field(ge=1)] = 256
    max_in_flight: Annotated[int, Field(ge=0)] = 0
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    start_parallel: Annotated[int, Field(ge=1, le=64)] = 1
    preload: bool = False
    kv_headroom: Amount = Percent(5.0)
    pressure_idle_s: Seconds = 2.0
    kv_share_min: Amount = Percent(2.0)
    kv_share_min_weights: Annotated[float, Field(ge=0.0, le=16.0)] = 0.0
    suspend_busy: bool = True
    min_awake_s: Seconds = 5.0
    max_suspend_s: PositiveSeconds = 30.0
    host_budget: Amount | None = Percent(40.0)
    host_memory: Size | None = None
    host_arena_dir: Path | None = None
    log_dir: Path | None = None

    @model_validator(mode="after")
    def _tls(self) -> ServerConfig:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together")
        return self

    @model_validator(mode="before")
    @classmethod
    def _paths(cls, data: Any) -> Any:
        # TOML has no path type: accept strings for the path fields under strict mode.
        if isinstance(data, dict):
            for key in _PATH_KEYS:
                if isinstance(data.get(key), str):
                    data = {**data, key: Path(data[key]).expanduser()}
        return data


class ModelConfig(_Table):
    """One ``[[models]]`` entry (see the module docstring)."""

    name: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^\S+$")]
    engine: Literal["vllm", "sglang", "command"] = "vllm"
    model: Annotated[str, Field(min_length=1)]
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    idle_sleep_s: Seconds | None = None
    pinned: bool = False
    priority: int = 0
    weights_bytes: Size | None = None
    max_in_flight: Annotated[int, Field(ge=0)] | None = None
    # engine = "command" only
    command: list[str] | None = None
    health_path: str = "/health"
    sleep_path: str | None = None
    wake_path: str | None = None
    demote_path: str | None = None

    @model_validator(mode="after")
    def _command(self) -> ModelConfig:
        own = {
            "command": self.command,
            "sleep_path": self.sleep_path,
            "wake_path": self.wake_path,
            "demote_path": self.demote_path,
        }
        if self.engine != "command":
            given = [k for k, v in own.items() if v is not None]
            if given:
                raise ValueError(f'{given[0]} is for engine = "command" only')
            return self
        if not self.command:
            raise ValueError('engine = "command" needs command = ["...", "{port}", ...]')
        if not any("{port}" in part for part in self.command):
            raise ValueError("command must contain {port}: the server picks the engine's port")
        if (self.sleep_path is None) != (self.wake_path is None):
            raise ValueError("sleep_path and wake_path go together")
        if self.demote_path is not None and self.sleep_path is None:
            raise ValueError("demote_path needs sleep_path and wake_path")
        for key in ("health_path", "sleep_path", "wake_path", "demote_path"):
            value = getattr(self, key)
            if value is not None and not value.startswith("/"):
                raise ValueError(f"{key} must be a path starting with /, got {value!r}")
        return self

    @property
    def pool_name(self) -> str:
        """The elastic pool name the engine registers its KV cache under (see :func:`pool_name_for`)."""
        return pool_name_for(self.name)


def pool_name_for(model_name: str) -> str:
    """``serve.<name>`` with characters a pool name cannot hold replaced by ``_`` (64 characters at most)."""
    return ("serve." + _POOL_CHARS.sub("_", model_name))[:64]


class ServeConfig(_Table):
    """The whole config: one server, one or more models with distinct names and pool names."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    models: list[ModelConfig]

    @model_validator(mode="after")
    def _distinct(self) -> ServeConfig:
        if not self.models:
            raise ValueError("at least one [[models]] entry is needed")
        seen: dict[str, str] = {}
        for model in self.models:
            for key in (model.name, "pool " + model.pool_name):
                if key in seen:
                    raise ValueError(
                        f"two models are called {model.name!r} (or share pool {model.pool_name})"
                    )
                seen[key] = model.name
        for i, entry in enumerate(self.server.api_keys):
            unknown = [m for m in entry.models or () if m not in seen]
            if unknown:
                raise ValueError(f"server.api_keys[{i}]: no model is called {unknown[0]!r}")
        return self

    def max_in_flight(self, model: ModelConfig) -> int:
        """The requests ``model`` serves at once (its own limit, else the server's); 0 = no limit."""
        return self.server.max_in_flight if model.max_in_flight is None else model.max_in_flight

    def idle_sleep_s(self, model: ModelConfig) -> float:
        """The model's idle time before it sleeps (its own, else the server's default); 0 = never."""
        if model.pinned:
            return 0.0
        return self.server.idle_sleep_s if model.idle_sleep_s is None else model.idle_sleep_s


def check_model_paths(config: ServeConfig) -> None:
    """:class:`ConfigError` (one line) for a vLLM or SGLang model given as a local path (``/...``, ``./...``,
    ``../...``, ``~...``) that does not exist; other values are hub ids, the engine's to resolve."""
    for i, model in enumerate(config.models):
        if model.engine == "command" or not model.model.startswith(("/", "./", "../", "~")):
            continue
        if not Path(model.model).expanduser().exists():
            raise ConfigError(f"models[{i}].model: {model.model} does not exist")


def _table_of(loc: Sequence[Any]) -> type[BaseModel]:
    """The table (model class) that holds the key at the end of ``loc``."""
    table: type[BaseModel] = ServeConfig
    for part in loc[:-1]:
        if not isinstance(part, str) or part not in table.model_fields:
            continue
        stack = [table.model_fields[part].annotation]
        while stack:
            kind = stack.pop()
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                table = kind
                break
            stack.extend(get_args(kind))
    return table


def _first_error(exc: ValidationError, source: str) -> ConfigError:
    err = exc.errors()[0]
    loc = ""
    for part in err["loc"]:
        loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        message = "unknown key"
        close = difflib.get_close_matches(str(err["loc"][-1]), list(_table_of(err["loc"]).model_fields), n=1)
        if close:
            message += f" (did you mean {close[0]}?)"
    return ConfigError(f"{source}: {loc or 'config'}: {message}")


def parse_config(data: dict[str, Any], source: str = "config") -> ServeConfig:
    """Validate a parsed TOML document; :class:`ConfigError` naming the first bad key."""
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as exc:
        raise _first_error(exc, source) from None


def load_config(path: Path, server: dict[str, Any] | None = None) -> ServeConfig:
    """Read and validate a TOML config file, ``server`` (command-line values) over its ``[server]`` table;
    :class:`ConfigError` for a missing, malformed or bad file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    if server:
        table = data.get("server", {})
        data["server"] = {**table, **server} if isinstance(table, dict) else table
    return parse_config(data, str(path))


def quick_config(
    models: Sequence[str], engine: str = "vllm", server: dict[str, Any] | None = None
) -> ServeConfig:
    """The config of ``--model NAME=PATH`` flags (every model on ``engine``, the server's defaults)."""
    entries: list[dict[str, Any]] = []
    for i, item in enumerate(models):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--model[{i}]: {item!r}: expected NAME=PATH")
        entries.append({"name": name, "engine": engine, "model": path})
    return parse_config({"server": dict(server or {}), "models": entries}, "command line")


def _toml_value(value: Any) -> str:
    """A TOML literal for a str, bool, number, list or flat dict (what a config's values are)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML literal for {value!r}")


def render_config(server: dict[str, Any], models: Sequence[dict[str, Any]]) -> str:
    """A config file's text (TOML) for the ``[server]`` table ``server`` and one ``[[models]]`` table per
    entry of ``models``, as :func:`load_config` reads it back (unvalidated); ``TypeError`` for a value
    other than a str, bool, number, list or flat table."""
    lines = ["[server]", *(f"{k} = {_toml_value(v)}" for k, v in server.items())]
    for model in models:
        lines += ["", "[[models]]", *(f"{k} = {_toml_value(v)}" for k, v in model.items())]
    return "\n".join(lines) + "\n"
