"""Driver process of :class:`tests.support.sglang_engine.EngineProcess`: owns one ``sglang.Engine``.

Run as ``python -m tests.support.sglang_driver FD`` with the SGLang CPU environment; ``FD`` is the
inherited end of a ``multiprocessing`` pipe. The first message holds the engine's keyword arguments;
every later one is ``{"method", "args", "kwargs"}`` and gets ``{"ok", "result"|"error"}`` back.
Besides the engine's own methods it answers ``__children__`` (pids of the engine's processes) and
``__shutdown__``.
"""

from __future__ import annotations

import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any


def _children(engine: Any) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True)]


def main(fd: int) -> None:
    conn = Connection(fd)
    kwargs = conn.recv()
    try:
        import sglang

        engine = sglang.Engine(**kwargs)
    except BaseException as exc:  # report any start-up failure to the test, then exit
        conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
        raise SystemExit(1) from None
    conn.send({"ok": True, "child_pids": _children(engine)})
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        method = msg["method"]
        if method == "__shutdown__":
            engine.shutdown()
            conn.send({"ok": True})
            break
        try:
            if method == "__children__":
                result = _children(engine)
            else:
                result = getattr(engine, method)(*msg["args"], **msg["kwargs"])
            conn.send({"ok": True, "result": result})
        except Exception as exc:
            conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})


if __name__ == "__main__":
    main(int(sys.argv[1]))
