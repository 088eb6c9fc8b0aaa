"""Compare two JSON records: numbers within a relative tolerance, everything else exactly.

A record re-derived on another machine may differ from the committed one in the last bit of a float: a
geometric mean through ``exp``/``log`` rounds differently on another CPU's vector math library (seen: an
Intel Xeon re-derived 0.9777911306522752 where the AMD EPYC that wrote the record had ...753). Values that
must be bitwise (exact resume, ranks that agree) are compared by the tests that own them, within one run.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["REL_TOL", "record_differences"]

REL_TOL = 1e-12  # a few ULPs of a float64 near 1 are ~1e-16: rounding, never a changed estimate


def record_differences(got: Any, want: Any, rel_tol: float = REL_TOL, path: str = "") -> list[str]:
    """Where ``got`` differs from ``want``: ``path: got != want`` per difference (empty when they agree).

    Floats (and ints against floats) agree within ``rel_tol`` of the larger magnitude; NaN equals NaN; bools,
    ints, strings, ``None`` and the keys and lengths of dicts and lists must be equal."""
    where = path or "/"
    if isinstance(want, dict) and isinstance(got, dict):
        if got.keys() != want.keys():
            return [f"{where}: keys {sorted(got)} != {sorted(want)}"]
        return [d for key in want for d in record_differences(got[key], want[key], rel_tol, f"{path}/{key}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{where}: length {len(got)} != {len(want)}"]
        return [
            d
            for i, (g, w) in enumerate(zip(got, want, strict=True))
            for d in record_differences(g, w, rel_tol, f"{path}/{i}")
        ]
    if _is_number(got) and _is_number(want) and (isinstance(got, float) or isinstance(want, float)):
        same = (math.isnan(got) and math.isnan(want)) or math.isclose(got, want, rel_tol=rel_tol, abs_tol=0.0)
        return [] if same else [f"{where}: {got!r} != {want!r}"]
    return [] if type(got) is type(want) and got == want else [f"{where}: {got!r} != {want!r}"]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
