"""Parses SGLang command lines the way ``launch_server`` / ``sglang serve`` do, in a fresh process.

``python -m tests.support.sglang_cli_probe '<json list of argv lists>'`` loads the plugins, runs
``prepare_server_args`` on each argv and prints one JSON line: per argv, the exit code argparse asked
for (or None), the ``ServerArgs`` fields, ``ELASTIC_KV_SGLANG_BACKEND`` after parsing, and the help text
when ``--help`` was given. Used by tests/sglang/test_cli.py (sglang imports take seconds: one process
for many command lines).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any


def probe(argvs: list[list[str]]) -> list[dict[str, Any]]:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt import server_args as sa_mod

    results = []
    for argv in argvs:
        os.environ.pop("ELASTIC_KV_SGLANG_BACKEND", None)
        out, err = io.StringIO(), io.StringIO()
        record: dict[str, Any] = {"argv": argv, "exit": None, "fields": None}
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                args = sa_mod.prepare_server_args(argv)
            record["fields"] = {k: repr(getattr(args, k)) for k in sorted(args.__struct_fields__)}
        except SystemExit as exc:
            record["exit"] = exc.code
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
        record["stdout"] = out.getvalue()
        record["stderr"] = err.getvalue()[-2000:]
        record["env"] = os.environ.get("ELASTIC_KV_SGLANG_BACKEND")
        results.append(record)
    return results


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))
