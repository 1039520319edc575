"""A bad ``ELASTIC_KV_*`` setting stops ``vllm serve ... --kv-cache-backend=elastic`` in the front end.

vLLM's OpenAI server module is started as an operator starts it; the plugin resolves its settings when
``EngineArgs.from_cli_args`` runs, before an engine core exists, so the command ends at once with one line
that names the variable and shows a valid value, exit status 2, and no traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_engines import tiny_model

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("ELASTIC_KV_PAGE_SIZE", "abc", "e.g. 512M"),
        ("ELASTIC_KV_PAGE_SIZE", "3", "e.g. 2M"),
        ("ELASTIC_KV_LIMIT", "-1", "it is negative"),
    ],
)
def test_bad_setting_is_one_line_before_the_engine_starts(
    variable: str, value: str, expected: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_KV_")}
    env.update({variable: value, "ELASTIC_KV_REGISTRY_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model()),
           "--kv-cache-backend", "elastic", "--port", "0"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    ours = [line for line in done.stderr.splitlines() if line.startswith("vllm-elastic-kv:")]
    assert len(ours) == 1, done.stderr[-3000:]
    assert variable in ours[0] and repr(value) in ours[0] and expected in ours[0], ours[0]
    assert "Traceback" not in done.stderr
    assert "EngineCore" not in done.stderr  # no engine process was started
    assert not list(tmp_path.iterdir())  # nor any pool
