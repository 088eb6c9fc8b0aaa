"""The SyncBatchNorm benchmark's analysis and report (:mod:`benchmarks.batchnorm.syncbn` measures): every
estimate, verdict and table is derived from the record's raw slowest-rank samples, so a stored record can be
re-analysed and its report rewritten (``python -m benchmarks.rederive syncbn``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.harness import round_estimates, verdict
from benchmarks.report import Panel, fmt_bytes, fmt_value, headline_row, publish, table

__all__ = ["KERNELS", "estimates", "headline", "parse_shape", "shape_kind", "shape_label", "write"]

KERNELS = ("custom", "shared", "compiled", "eager")  # the numerators of every ratio
SHARED_TARGET = 1.0  # max shared/floor: the statistics through shared memory cost no more than 2 gloo all-reduces
TITLE = "SyncBatchNorm: forward+backward time and peak memory"
KINDS = {"nc": "(N, C)", "conv": "(N, C, H, W)"}


def shape_kind(shape: list[int] | tuple[int, ...]) -> str:
    """``conv`` for (N, C, H, W) shapes, ``nc`` for (N, C) ones."""
    return "conv" if len(shape) >= 4 else "nc"


def shape_label(row: dict[str, Any]) -> str:
    """A record row's shape as the command line writes it: ``32x64x16x16``."""
    return "x".join(map(str, row["shape"]))


def parse_shape(text: str) -> tuple[int, ...]:
    """A ``--shapes`` value (``32x64x16x16``) as a shape tuple."""
    return tuple(map(int, text.split("x")))


def estimates(samples: dict[str, list[float]], run_length: int) -> dict[str, Any]:
    """Medians and the ratios of custom over every other method (CIs) from one shape's slowest-rank samples,
    kept flat in rounds of ``run_length`` calls (each round is resampled whole)."""
    pairs = [(a, b) for a in KERNELS for b in samples if b not in KERNELS]
    extra = [("shared", "custom"), ("compiled", "custom"), ("custom", "eager"), ("python_floor", "local")]
    return round_estimates(samples, run_length, [*pairs, *extra])


def _judged(rows: list[dict[str, Any]], key: str, targets: dict[str, float]) -> list[tuple[dict, str, float]]:
    """(row, verdict, target) of ``key`` for every row that has it, the target by shape kind."""
    judged = [(row, targets[shape_kind(row["shape"])]) for row in rows if key in row["ratios"]]
    return [(row, verdict(row["ratios"][key], target), target) for row, target in judged]


def _kind_rows(rows: list[dict], key: str, targets: dict[str, float], what: str, kind: str) -> list[dict[str, Any]]:
    """The worst ratio ``key`` of the shapes of one kind, with its verdict, and how many shapes met the target."""
    judged = _judged([r for r in rows if shape_kind(r["shape"]) == kind], key, targets)
    if not judged:
        return []
    worst, _, target = max(judged, key=lambda j: j[0]["ratios"][key]["value"])
    tally, label = Counter(v for _, v, _ in judged), KINDS[kind]
    return [
        headline_row(f"{what}: worst {label} shape ({shape_label(worst)})", worst["ratios"][key], "x", target),
        headline_row(
            f"{what}: {label} shapes meeting <= {target:g}",
            f"{tally['met']} met, {tally['missed']} missed, {tally['undecided']} undecided of {len(judged)}",
        ),
    ]


def _memory_rows(rows: list[dict], base: str, ranks: str) -> list[dict[str, Any]]:
    """Against torch's SyncBatchNorm Function (a GPU record): the layer's peak memory over torch's, the worst shape
    (target <= 1: bytes an allocator counted, no interval); CPU records have no such baseline."""
    if base != "torch_syncbn" or not rows:
        return []
    peaks = [(row["peak_bytes"]["custom"] / row["peak_bytes"][base], row) for row in rows]
    ratio, worst = max(peaks, key=lambda peak: peak[0])
    extra = fmt_bytes(worst["peak_bytes"]["custom"] - worst["peak_bytes"][base])
    what = f"SyncBN peak memory / {base}, {ranks}: worst shape ({shape_label(worst)}, {extra} more)"
    met = sum(peak <= 1.0 for peak, _ in peaks)
    return [
        headline_row(what, round(ratio, 4), "x", 1.0),
        headline_row(f"SyncBN peak memory / {base}, {ranks}: shapes meeting <= 1", f"{met} met of {len(peaks)}"),
    ]


def headline(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per shape kind: the worst ratio with its verdict and how many shapes met the target, for the
    synchronised layer against its baseline and for the kernel alone against torch's BatchNorm."""
    cfg, rows, one_rank = record["config"], record["rows"], record.get("one_rank_rows", [])
    base, ranks, target = cfg["baseline"], f"{cfg['world_size']} ranks", dict.fromkeys(KINDS, cfg["target"])
    ranks += "" if cfg.get("dtype", "float32") == "float32" else f", {cfg['dtype']}"  # a bf16 run's rows say so
    floor = "local BN + 2 all-reduces" if base == "floor" else "torch"
    one_rank_targets, compiled_targets = cfg.get("one_rank_targets", {}), cfg.get("compiled_targets", {})
    shared = "SyncBN, statistics through shared memory"
    checks = [  # the rows, the ratio judged, its targets by shape kind, what it is
        (rows, f"custom/{base}", target, f"SyncBN / {base} ({floor}), {ranks}"),
        (rows, "shared/floor", dict.fromkeys(KINDS, SHARED_TARGET), f"{shared} / floor ({floor}, gloo), {ranks}"),
        (one_rank, "custom/local", one_rank_targets, "SyncBN kernel / torch BatchNorm, 1 rank"),
        (rows, f"compiled/{base}", target, f"SyncBN compiled / {base}, {ranks}"),
        (one_rank, "compiled/local", compiled_targets, "SyncBN kernel compiled / torch BatchNorm, 1 rank"),
    ]
    out = [row for check in checks for kind in KINDS for row in _kind_rows(*check, kind)]
    out += _memory_rows(rows, base, ranks)
    floors = [r for r in one_rank if "python_floor/local" in r["ratios"] and shape_kind(r["shape"]) == "nc"]
    if floors:  # what a layer written as a Python autograd.Function pays before any arithmetic
        worst = max(floors, key=lambda r: r["ratios"]["python_floor/local"]["value"])
        what = "Python autograd.Function floor (copies x and grad) / torch BatchNorm, 1 rank: worst (N, C) shape"
        what += f" ({shape_label(worst)})"
        out.append(headline_row(what, worst["ratios"]["python_floor/local"], "x"))
    for shapes, when in ((rows, "empty inductor cache, 2-rank run"), (one_rank, "warm cache, 1-rank run after it")):
        if any("compile_s" in row for row in shapes):  # the first shape pays the fixed cost, later ones their graphs
            first, rest = shapes[0].get("compile_s", 0.0), [row.get("compile_s", 0.0) for row in shapes[1:]]
            what = f"SyncBN compiled: first call ({when}): first shape ({shape_label(shapes[0])}) / slowest later shape"
            out.append(headline_row(what, f"{first:.1f} s / {max(rest, default=0.0):.1f} s"))
    return out


def _table(rows: list[dict[str, Any]], key: str, targets: dict[str, float]) -> list[str]:
    methods, memory = list(rows[0]["median_s"]), list(rows[0]["peak_bytes"])
    keys = [key, *(k for k in rows[0]["ratios"] if k != key)]  # the target's ratio first
    headers = ["shape per rank", *methods, *(k.replace("/", " / ") for k in keys)]
    headers += [f"{key} verdict", f"{key} CI includes 1?", *(f"{m} peak memory" for m in memory)]
    cells = [
        [shape_label(row), *(fmt_value(row["median_s"][m], "s") for m in methods)]
        + [fmt_value(row["ratios"][k]) for k in keys]
        + [f"{v} (<= {t:g})", row["ratios"][key]["low"] <= 1.0 <= row["ratios"][key]["high"]]
        + [fmt_bytes(row["peak_bytes"][m]) for m in memory]
        for row, v, t in _judged(rows, key, targets)
    ]
    return table(headers, cells)


def _compiled_table(rows: list[dict[str, Any]], key: str, targets: dict[str, float]) -> list[str]:
    """The compiled kernel's verdicts and first-call (compile) time per shape."""
    cells = [
        [shape_label(row), fmt_value(row["ratios"][key]), fmt_value(row["ratios"].get("compiled/custom"))]
        + [f"{v} (<= {t:g})", fmt_value(row.get("compile_s"), "s")]
        for row, v, t in _judged(rows, key, targets)
    ]
    headers = ["shape per rank", key.replace("/", " / "), "compiled / custom (eager)", f"{key} verdict"]
    return table([*headers, "first call (compiles)"], cells)


def _body(record: dict[str, Any]) -> list[str]:
    cfg, rows, one_rank = record["config"], record["rows"], record["one_rank_rows"]
    target = dict.fromkeys(KINDS, cfg["target"])
    compiled = []
    if "compiled_targets" in cfg:  # records before the compiled kernel have none
        compiled = [
            f"## The compiled kernel (`compile=True`): {cfg['world_size']} ranks, then one rank",
            "",
            *_compiled_table(rows, f"compiled/{cfg['baseline']}", target),
            "",
            *_compiled_table(one_rank, "compiled/local", cfg["compiled_targets"]),
            "",
        ]
    return [
        f"{cfg['world_size']} ranks ({cfg['backend']}, {cfg['threads']} thread(s) each); {cfg['rounds']} rounds x "
        f"{cfg['iters']} iterations per method after {cfg['warmup']} warm-up; wall time {record['wall_s']:.0f} s.",
        "",
        *_table(rows, f"custom/{cfg['baseline']}", target),
        "",
        "## The kernel on one rank: custom vs torch's BatchNorm (`local`)",
        "",
        *_table(one_rank, "custom/local", cfg["one_rank_targets"]),
        "",
        *compiled,
        "![time and ratios per shape](syncbn.png)",
    ]


def _panels(record: dict[str, Any]) -> list[Panel]:
    cfg, rows, one_rank = record["config"], record["rows"], record["one_rank_rows"]
    groups = [shape_label(row) for row in rows]
    times = {m: [row["median_s"][m] for row in rows] for m in rows[0]["median_s"]}
    shown = {k: [row["ratios"][k] for row in rows] for k in rows[0]["ratios"]}
    shown |= {f"{k}/native, 1 rank": [row["ratios"].get(f"{k}/local") for row in one_rank] for k in KERNELS}
    lines = {"1": 1.0, f"target {cfg['target']}x {cfg['baseline']}": cfg["target"]}
    lines |= {f"1-rank target {KINDS[k]}": t for k, t in cfg["one_rank_targets"].items()}
    return [
        Panel("forward+backward", "ms (median, slowest rank)", groups, times, scale=1e3, log=True),
        Panel("ratios of medians", "ratio", groups, shown, log=True, lines=lines),
    ]


def write(record: dict[str, Any], out: Path) -> None:
    """Write results.json, results.md and syncbn.png for ``record`` into ``out``."""
    cfg = record["config"]
    for row in (*record["rows"], *record["one_rank_rows"]):  # from the kept samples: a record re-derives the same way
        row.update(estimates(row["samples_s"], cfg["iters"]))
    record["headline"] = headline(record)
    plot_title = f"SyncBatchNorm, {cfg['world_size']} ranks, {cfg['device']} / {cfg['backend']}"
    publish(out, record, TITLE, _body(record), {"syncbn.png": (plot_title, _panels(record))})
