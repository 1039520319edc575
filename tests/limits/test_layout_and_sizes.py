"""The binary layouts (fit, alignment, snapshot coverage, text fields) and operator size parsing."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from elastic_kv.registry import LatencyHistogram
from elastic_kv.registry.layout import (
    HISTOGRAM_BOUNDS,
    SNAPSHOT_APPENDED_INT_FIELDS,
    SNAPSHOT_INT_FIELDS,
    DeviceLayout,
    FloatField,
    IntArray,
    IntField,
    RecordLayout,
    SlotLayout,
    TextField,
)
from elastic_kv.sizes import Percent, format_bytes, parse_amount, parse_size
from elastic_kv.snapshot import PoolSnapshot


def _fields(layout: type) -> list[tuple[str, int, int]]:
    """(name, offset, size) of every field of a layout class, arrays and per-op tuples flattened."""
    out: list[tuple[str, int, int]] = []
    for name, value in vars(layout).items():
        items = value if isinstance(value, tuple) else (value,)
        for i, item in enumerate(items):
            label = f"{name}[{i}]" if isinstance(value, tuple) else name
            if isinstance(item, IntField | FloatField):
                out.append((label, item.offset, item.codec.size))
            elif isinstance(item, TextField):
                out.append((label, item.offset, item.size))
            elif isinstance(item, IntArray):
                out.append((label, item.offset, 8 * item.count))
    return out


@pytest.mark.parametrize(
    ("layout", "size"), [(RecordLayout, RecordLayout.SIZE), (SlotLayout, SlotLayout.SIZE)]
)
def test_fields_fit_do_not_overlap_and_are_aligned(layout: type, size: int) -> None:
    fields = sorted(_fields(layout), key=lambda f: f[1])
    assert fields, "no fields found"
    for (name, offset, length), (next_name, next_offset, _) in itertools.pairwise(fields):
        assert offset + length <= next_offset, f"{name} overlaps {next_name}"
    last_name, last_offset, last_length = fields[-1]
    assert last_offset + last_length <= size, f"{last_name} runs past the end"
    for name, offset, length in fields:
        if length in (2, 4, 8) and "magic" not in name:
            assert offset % length == 0, f"{name} is misaligned"


def test_revisions_are_adjacent_for_poll() -> None:
    """PoolRecord.poll reads limit_revision and trim_revision with one unpack."""
    assert RecordLayout.trim_revision.offset == RecordLayout.limit_revision.offset + 8


def test_device_layout_fits() -> None:
    fields = sorted(_fields(DeviceLayout), key=lambda f: f[1])
    assert fields[-1][1] + fields[-1][2] <= DeviceLayout.slots_start
    assert DeviceLayout.slots_start + DeviceLayout.SLOTS * SlotLayout.SIZE == DeviceLayout.SIZE
    assert DeviceLayout.charges.offset % 8 == 0


def test_record_stores_every_snapshot_field() -> None:
    """A new PoolSnapshot field must come with a layout change, not be dropped; appended fields come after
    every field of version 2 (whose offsets never move)."""
    stored = set(SNAPSHOT_INT_FIELDS) | set(SNAPSHOT_APPENDED_INT_FIELDS) | {"name", "state", "timestamp"}
    assert {f.name for f in dataclasses.fields(PoolSnapshot)} == stored
    assert not set(SNAPSHOT_INT_FIELDS) & set(SNAPSHOT_APPENDED_INT_FIELDS)
    assert RecordLayout.appended_snapshot_ints.offset > RecordLayout.flags.offset
    end = RecordLayout.appended_snapshot_ints.offset + 8 * len(SNAPSHOT_APPENDED_INT_FIELDS)
    assert end <= RecordLayout.SIZE


def test_text_field_truncates_long_text_keeping_its_tail() -> None:
    field = TextField(0, 16)
    buf = bytearray(16)
    field.put(buf, "short")
    assert field.get(buf) == "short"
    field.put(buf, "/models/hub/snapshots/abcdef0123456789")
    value = field.get(buf)
    assert value.startswith("…") and value.endswith("0123456789")
    assert len(value.encode()) <= 16
    field.put(buf, "ééééééééééééééééé")  # 2-byte characters cut at an odd byte position
    assert field.get(buf).startswith("…") and "\ufffd" not in field.get(buf)


def test_histogram_quantiles_follow_buckets() -> None:
    counts = [0] * (len(HISTOGRAM_BOUNDS) + 1)
    counts[2] = 9  # 9 samples <= 50 us
    counts[-1] = 1  # 1 sample past the last bound
    hist = LatencyHistogram("map", HISTOGRAM_BOUNDS, tuple(counts), 1.5)
    assert hist.count == 10
    assert hist.quantile(0.5) == HISTOGRAM_BOUNDS[2]
    assert hist.quantile(0.9) == HISTOGRAM_BOUNDS[2]
    assert hist.quantile(0.99) == math.inf
    assert LatencyHistogram("map", HISTOGRAM_BOUNDS, (0,) * len(counts), 0.0).quantile(0.5) is None
    with pytest.raises(ValueError):
        hist.quantile(1.5)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("4096B", 4096),
        ("512K", 512 << 10),
        ("2M", 2 << 20),
        ("2MiB", 2 << 20),
        ("512M", 512 << 20),
        ("512m", 512 << 20),
        ("512MiB", 512 << 20),
        ("2GiB", 2 << 30),
        ("2gib", 2 << 30),
        ("2G", 2 << 30),
        ("1.5G", 3 << 29),
        ("1.5K", 1536),
        (".5M", 512 << 10),
        ("2GB", 2 << 30),  # binary, as docker and ElasticConfig read it
        ("100kb", 100 << 10),
        ("1T", 1 << 40),
        (" 64 MiB ", 64 << 20),
        (" 8 gb ", 8 << 30),
    ],
)
def test_parse_size_accepts(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "12X", "2X", "-5M", "-1", "M", "two", "1.5", "0.1K", "1.3K", "1e9", "2 G B", "5%", "0x10", "1,5G",
     "2Gi B"],
)  # fmt: skip
def test_parse_size_rejects_with_a_message(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_parse_amount_percentages() -> None:
    assert parse_amount("25%") == Percent(25.0)
    assert parse_amount("12.5 %") == Percent(12.5)
    assert parse_amount("100%") == Percent(100.0)
    assert parse_amount("1G") == 1 << 30
    assert Percent(25).of(1 << 30) == 1 << 28
    for bad in ("0%", "150%", "-5%", "%"):
        with pytest.raises(ValueError):
            parse_amount(bad)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (3 << 29, "1.50 GiB"), (100 << 20, "100 MiB"),
     (-(2 << 20), "-2.00 MiB"), (5 << 40, "5.00 TiB"), (5000 << 40, "5000 TiB")],
)  # fmt: skip
def test_format_bytes(nbytes: int, text: str) -> None:
    assert format_bytes(nbytes) == text
