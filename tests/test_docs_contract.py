"""``docs/ARCHITECTURE.md`` against the code: every Python signature it states names the parameters the code
takes, in the code's order. Each entry below ties a call as the document writes it (the text up to its
opening parenthesis, as it starts a line of the document) to the object it documents; a parameter added,
removed or renamed in the code and not in the document fails here, and so does an entry whose text the
document no longer has."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from elastic_kv.geometry import BlockGeometry, strided_families
from elastic_kv.ledger import Ledger
from elastic_kv.ledger.page_mapper import AsyncPageMapper, LocalMapper, PageMapper
from elastic_kv.ranks.coordinator import Coordinator
from elastic_kv.ranks.listener import SocketListener
from elastic_kv.ranks.rank import Rank
from elastic_kv.ranks.sockets import socket_dir, socket_path
from elastic_kv.ranks.transport import BroadcastTransport
from elastic_kv.registry import Registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"

# The call as the document writes it -> what it documents.
DOCUMENTED: dict[str, Callable[..., Any]] = {
    "geo = BlockGeometry(": BlockGeometry.__init__,
    "strided_families(": strided_families,
    "    def map(": PageMapper.map,
    "    def unmap(": PageMapper.unmap,
    "    def map_async(": AsyncPageMapper.map_async,
    "    def collect(": AsyncPageMapper.collect,
    "LocalMapper.for_geometry(": LocalMapper.for_geometry,
    "led = Ledger(": Ledger.__init__,
    "led.alloc(": Ledger.alloc,
    "led.free(": Ledger.free,
    "led.maintain(": Ledger.maintain,
    "led.resize(": Ledger.resize,
    "led.bytes_for_blocks(": Ledger.bytes_for_blocks,
    "reg = Registry(": Registry.__init__,
    "reg.set_limit(": Registry.set_limit,
    "reg.set_budget(": Registry.set_budget,
    "c = Coordinator(": Coordinator.__init__,
    "c.unmap(": Coordinator.unmap,
    "rank = Rank(": Rank.__init__,
    "BroadcastTransport(": BroadcastTransport.__init__,
    "SocketListener(": SocketListener.__init__,
    "socket_dir(": socket_dir,
    "socket_path(": socket_path,
}


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def documented_parameters(doc: str, call: str) -> list[str]:
    """The parameter names the document gives ``call`` (the first line that starts with it)."""
    match = re.search("^" + re.escape(call), doc, re.M)
    assert match is not None, f"docs/ARCHITECTURE.md no longer has {call.strip()!r}"
    depth, start = 1, match.end()
    for end in range(start, len(doc)):
        depth += {"(": 1, ")": -1}.get(doc[end], 0)
        if depth == 0:
            break
    inside = re.sub(r"#[^\n]*", "", doc[start:end])  # comments inside a call that spans lines
    names = [re.split(r"[:=\s]", p, maxsplit=1)[0] for p in _split_top_level(inside)]
    return [n for n in names if n not in ("*", "/", "self", "cls")]


def code_parameters(obj: Callable[..., Any]) -> list[str]:
    params = inspect.signature(obj).parameters.values()
    return [p.name for p in params if p.name not in ("self", "cls")]


@pytest.mark.parametrize("call", sorted(DOCUMENTED))
def test_documented_signature_matches_the_code(call: str) -> None:
    assert documented_parameters(DOC.read_text(), call) == code_parameters(DOCUMENTED[call]), call.strip()


README = DOC.parents[1] / "README.md"
SOURCES = DOC.parents[1] / "packages"


def test_the_readme_names_every_folder_of_the_packages() -> None:
    """The README's layout section gives each subpackage (a folder with an ``__init__.py`` below a
    package's top level) a line of its own: a folder added or renamed without it fails here."""
    text = README.read_text()
    folders = sorted(
        f"{init.parent.parent.name}/{init.parent.name}/"
        for init in SOURCES.glob("*/src/*/*/__init__.py")
        if "egg-info" not in str(init)
    )
    missing = [f for f in folders if not re.search(rf"^{re.escape(f)}\s", text, re.MULTILINE)]
    assert folders and not missing, f"README.md's layout section lacks {missing}"


LONG_FILE_LINES = 400
LONG_FILE_REASON = "One file over 400 lines on purpose:"


def test_every_product_file_over_400_lines_says_why_at_its_top() -> None:
    """A product source file (a package's Python, the C++ data plane) longer than 400 lines states in its
    first lines why it is one file: a file that grows past it without a reason fails here."""
    root = SOURCES.parent
    files = [
        *SOURCES.glob("*/src/**/*.py"),
        *root.glob("core_ext/src/*.cpp"),
        *root.glob("core_ext/include/**/*.hpp"),
    ]
    long = [f for f in files if "egg-info" not in str(f)
            and len(f.read_text().splitlines()) > LONG_FILE_LINES]  # fmt: skip
    silent = [
        str(f.relative_to(root))
        for f in long
        if LONG_FILE_REASON not in "".join(f.read_text().splitlines(True)[:8])
    ]
    assert long and not silent, f"over {LONG_FILE_LINES} lines without a reason at the top: {silent}"
