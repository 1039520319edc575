"""What the server says when an engine fails to start (the line of its log that names the cause), and the
environment it starts an engine with."""

from __future__ import annotations

from pathlib import Path

import pytest
from elastic_kv_serve.config import ModelConfig
from elastic_kv_serve.engines import cause_in_log, engine_env

PYDANTIC = """INFO 12-05 api_server.py:1] vLLM API server version 0.32.0
Traceback (most recent call last):
  File "/x/arg_utils.py", line 1955, in create_model_config
    return ModelConfig(
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, max_model_len (999999) is greater than the derived max_model_len [type=value_error]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""
WRAPPED = """(EngineCore pid=7) ERROR 12-05 core.py:1] EngineCore failed to start.
(EngineCore pid=7) ERROR 12-05 core.py:2] ValueError: No available memory for the cache blocks.
Traceback (most recent call last):
  File "/x/api_server.py", line 1, in <module>
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


@pytest.mark.parametrize(
    ("log", "cause"),
    [
        (PYDANTIC, "ValidationError: 1 validation error for ModelConfig Value error, max_model_len (999999) "
                   "is greater than the derived max_model_len [type=value_error]"),
        (WRAPPED, "ValueError: No available memory for the cache blocks."),
        ("RuntimeError: Engine core initialization failed. See root cause above.\n",
         "RuntimeError: Engine core initialization failed. See root cause above."),
        ("starting\ntorch.OutOfMemoryError: CUDA out of memory\nINFO shutting down\n",
         "OutOfMemoryError: CUDA out of memory"),
        ("starting\nKilled\n\n", "Killed"),
        ("", "(empty log)"),
    ],
)  # fmt: skip
def test_the_cause_is_the_last_exception_that_does_not_point_back(log: str, cause: str) -> None:
    assert cause_in_log(log) == cause


def test_the_cause_is_one_bounded_line() -> None:
    found = cause_in_log("ValueError: " + "x" * 1000 + "\n  more\n")
    assert len(found) == 300 and "\n" not in found


def test_the_servers_engines_park_a_suspensions_kv_unless_a_model_says_otherwise(tmp_path: Path) -> None:
    """``ELASTIC_KV_PARK_KV=1`` in every engine's environment (their weights never change while asleep), a
    model's own ``env`` winning; the pool name and the registry always the server's."""
    plain = ModelConfig(name="a", engine="vllm", model="/m")
    own = ModelConfig(name="b", engine="vllm", model="/m", env={"ELASTIC_KV_PARK_KV": "0"})
    env = engine_env(plain, tmp_path, base={"ELASTIC_KV_POOL_NAME": "x"})
    assert env["ELASTIC_KV_PARK_KV"] == "1" and env["ELASTIC_KV_POOL_NAME"] == plain.pool_name
    assert env["ELASTIC_KV_REGISTRY_DIR"] == str(tmp_path)
    assert engine_env(own, tmp_path, base={})["ELASTIC_KV_PARK_KV"] == "0"
