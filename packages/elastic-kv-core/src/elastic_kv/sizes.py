"""Byte sizes as operators write them (``512M``, ``2GiB``, ``1.5G``, ``30%``) and as ``kvctl`` prints them.

Units are binary whichever way they are written -- ``512M`` = ``512MB`` = ``512MiB`` = 512 * 2**20 -- as
``docker``, kvcached's ``kvctl`` and ``ElasticConfig``'s ``ELASTIC_KV_*`` sizes read them: an operator who
types ``8GB`` for a GPU means what ``nvidia-smi`` shows, not 8 * 10**9. Case does not matter. A number
without unit, or with ``B``, is bytes. The result must be a whole number of bytes; a negative size is
refused with a message that says it is negative.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal

__all__ = ["Percent", "format_bytes", "parse_amount", "parse_size"]

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])i?b?|b?)\s*", re.IGNORECASE)
_PERCENT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*")
_NEGATIVE = re.compile(r"\s*-\s*\.?\d")
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SIZE_HELP = "use a number of bytes with an optional binary unit, e.g. 512M, 2GiB, 1.5G, 4096"


@dataclass(frozen=True, slots=True)
class Percent:
    """A share of something else (a device budget, the device's memory), 0 < value <= 100."""

    value: float

    def of(self, whole: int) -> int:
        """This share of ``whole`` bytes, rounded down."""
        return int(Decimal(whole) * Decimal(str(self.value)) / 100)


def parse_size(text: str) -> int:
    """Bytes for ``text`` (see the module docstring); ``ValueError`` naming the problem otherwise.

    Fractions are allowed when they come to whole bytes (``1.5K`` = 1536, not ``0.1K``).
    """
    match = _SIZE.fullmatch(text)
    if match is None:
        if _NEGATIVE.match(text):
            raise ValueError(f"invalid size {text!r}: it is negative; sizes are >= 0, e.g. 512M")
        raise ValueError(f"invalid size {text!r}: {_SIZE_HELP}")
    number, letter = match.group(1), match.group(2)
    value = Decimal(number) * (1 if letter is None else 1024 ** _POWERS[letter.lower()])
    if value != value.to_integral_value():
        raise ValueError(f"invalid size {text!r}: it is not a whole number of bytes")
    return int(value)


def parse_amount(text: str) -> int | Percent:
    """A size in bytes (:func:`parse_size`) or a percentage (``30%``, 0 < p <= 100); ``ValueError`` else."""
    match = _PERCENT.fullmatch(text)
    if match is None:
        if text.strip().endswith("%") and _NEGATIVE.match(text):
            raise ValueError(f"invalid percentage {text!r}: it is negative; use one above 0%, e.g. 25%")
        return parse_size(text)
    value = float(match.group(1))
    if not 0.0 < value <= 100.0:
        raise ValueError(f"invalid percentage {text!r}: it must be above 0% and at most 100%")
    return Percent(value)


def format_bytes(nbytes: int) -> str:
    """``nbytes`` in binary units with three significant digits: ``512 B``, ``1.50 GiB``, ``-2.0 MiB``."""
    sign = "-" if nbytes < 0 else ""
    size = float(abs(nbytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024.0 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(size)} B"
            digits = 2 if size < 10 else 1 if size < 100 else 0
            return f"{sign}{size:.{digits}f} {unit}"
        size /= 1024.0
    raise AssertionError("unreachable")
