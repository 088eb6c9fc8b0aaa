"""The layer every benchmark shares: options, rounds, estimates and the record (:mod:`benchmarks.report` shows it).

    args = parse(parser("demo", __doc__), argv, FULL, QUICK)  # --out, --quick, --max-wait-s; args.cfg
    run_benchmark("demo", args.cfg, argv, write, measure, args.out, args.max_wait_s)  # quiet machine, record

    def measure():                                            # the record's raw sections
        return {"samples_s": interleave(["a", "b"], rounds=5, run=time_one)}  # a b / b a / a b ...

    def write(record, out):                                   # from the record alone: rederive calls it too
        record["headline"] = [headline_row("a / b", ratios(record["samples_s"], [("a", "b")])["a/b"], "x", 1.2)]
        publish(out, record, "Demo", body, {"demo.png": ("Demo", panels)})  # results.json/.md, plots

Intervals, quietness, peak memory and barrier-aligned times come from the Lightning-free
measurement modules the callbacks use too (:mod:`measure.stats`, ``run_info``, ``memory``,
``timing``). Records keep times in **seconds**, memory in **bytes**, estimates as ``{"value", "low",
"high", "n"}``, verdicts as values and each run's intra-op threads. Each benchmark derives analysis,
``headline(record)`` and report in ONE module, its own ``benchmarks/<name>.py``. ``--quick``
never writes into ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from measure.run_info import Quietness, environment, wait_for_quiet
from measure.stats import Estimate, in_runs, median_ci, ratio_ci
from measure.timing import aligned_seconds, slowest_rank

SCHEMA = "lit_cifar.bench/v3"
RESULTS = Path(__file__).resolve().parent / "results"
Verdict = Literal["met", "missed", "undecided"]
_T = TypeVar("_T")


def results_folder(benchmark: str) -> str:
    """A benchmark's default record folder under ``benchmarks/results/``: its module's own name
    (``syncbn`` for ``batchnorm.syncbn``)."""
    return benchmark.rsplit(".", 1)[-1]


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The options every benchmark has (``--out``, ``--quick``, ``--max-wait-s``); see :func:`parse`. ``name``
    is the module under ``benchmarks`` (``batchnorm.syncbn``): the record's ``benchmark``."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=(doc or "").split("\n\n")[0])
    folder = results_folder(name)
    p.add_argument("--out", type=Path, help=f"default: benchmarks/results/{folder}; with --quick a temporary folder")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny settings, no wait for a quiet machine")
    p.add_argument("--max-wait-s", type=float, help="wait this long for a quiet machine (default 300; --quick 0)")
    p.set_defaults(benchmark=name)
    return p


def parse(
    p: argparse.ArgumentParser, argv: Sequence[str] | None, full: dict | None = None, quick: dict | None = None
) -> argparse.Namespace:
    """Parse ``argv``, apply the quiet policy of the module docstring, refuse ``--device cuda`` without a GPU.
    With ``full`` settings, ``args.cfg`` is ``quick`` (``--quick``) or ``full``, and every option of the same
    name that was given on top."""
    args = p.parse_args(argv)
    name = results_folder(p.get_default("benchmark"))
    quick_out = Path(tempfile.gettempdir(), f"lit_cifar_{name}_quick")
    args.out = args.out or (quick_out if args.quick else Path("benchmarks/results", name))
    if args.quick and args.out.resolve().is_relative_to(RESULTS):
        p.error(
            f"--quick never writes into the committed results, but --out {args.out} is under {RESULTS}: "
            f"pass a folder elsewhere, e.g. --out /tmp/{name}"
        )
    if args.max_wait_s is None:
        args.max_wait_s = 0.0 if args.quick else 300.0
    if getattr(args, "device", "cpu") == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU; none is visible (torch.cuda.is_available(); use --device cpu)")
    if full is not None:
        given = {k: v for k, v in vars(args).items() if k in full and v is not None}
        args.cfg = (quick if args.quick else full) | given
    return args


def parse_step_rounds(
    name: str, doc: str | None, argv: Sequence[str] | None, rounds: int, steps: int, quick: tuple[int, int]
) -> tuple[argparse.Namespace, int, int]:
    """A benchmark of whole training steps on 1-thread ranks: its options (``--rounds``, ``--steps`` with these
    defaults), the rounds and steps to run (``quick`` with ``--quick``), and 1 intra-op thread here."""
    p = parser(name, doc)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--steps", type=int, default=steps)
    args = parse(p, argv)
    torch.set_num_threads(1)
    return args, *(quick if args.quick else (args.rounds, args.steps))


def settings(values: dict[str, tuple[Any, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``(full, quick)`` settings of a benchmark from ``{name: (full value, --quick value)}``."""
    return {k: full for k, (full, _) in values.items()}, {k: quick for k, (_, quick) in values.items()}


def run_benchmark(
    benchmark: str,
    config: dict[str, Any],
    argv: Sequence[str] | None,
    write: Callable[[dict[str, Any], Path], None],
    measure: Callable[[], dict[str, Any]],
    out: Path | str,
    max_wait_s: float,
    timed: bool = True,
) -> dict[str, Any]:
    """A benchmark's run: wait up to ``max_wait_s`` for a quiet machine, ``measure()`` the record's sections
    (with ``timed``, ``wall_s`` too), make the record of ``config`` (which ``measure`` may complete) and
    ``write(record, out)``; returns the record."""
    quiet = wait_for_quiet(max_wait_s=max_wait_s)
    started = time.monotonic()
    sections = measure()
    if timed:
        sections["wall_s"] = time.monotonic() - started
    record = make_record(benchmark, config, quiet.finish(), argv, **sections)
    write(record, Path(out))
    return record


def interleave(names: Sequence[str], rounds: int, run: Callable[[str, int], _T]) -> dict[str, list[_T]]:
    """``run(name, round)`` for every name in every round; the order alternates so drift hits all alike."""
    results: dict[str, list[_T]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else list(reversed(names)):
            results[name].append(run(name, i))
    return results


def timed_rounds(
    methods: dict[str, Callable[[], Any]],
    cfg: dict[str, int],
    device: Any = None,
    prepare: Callable[[str], Any] | None = None,
) -> dict[str, list[float]]:
    """Per-call seconds of every method on this rank: ``cfg["warmup"]`` untimed calls of each, then
    ``cfg["rounds"]`` interleaved rounds of ``cfg["iters"]`` barrier-aligned calls (``prepare(name)``
    before each, untimed). Every rank runs the same order: sample i is the same call on every rank.
    Kept flat, round after round: ``in_runs(samples, cfg["iters"])`` gives the rounds back for the intervals."""

    def once(name: str) -> float:
        (prepare or (lambda _: None))(name)
        return aligned_seconds(methods[name], device)

    for name in [n for _ in range(cfg["warmup"]) for n in methods]:  # warm-up, untimed
        once(name)
    rounds = interleave(list(methods), cfg["rounds"], lambda name, _: [once(name) for _ in range(cfg["iters"])])
    return {name: [s for block in blocks for s in block] for name, blocks in rounds.items()}


def slowest_ranks(per_rank: Sequence[dict[str, Any]], names: Iterable[str] | None = None) -> dict[str, list[float]]:
    """Per series (``names``, default all): the slowest rank's time of each barrier-aligned iteration."""
    return {name: slowest_rank([rank[name] for rank in per_rank]) for name in names or per_rank[0]}


def medians(samples: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The median of every series of ``samples`` with its 95 % CI, as record estimates."""
    return {name: asdict(median_ci(values)) for name, values in samples.items()}


def ratios(samples: dict[str, Any], pairs: Iterable[tuple[str, str]], ci: Callable = ratio_ci) -> dict[str, dict]:
    """``{"a/b": ci(samples[a], samples[b])}`` (record estimates) for every pair whose two series are kept."""
    return {f"{a}/{b}": asdict(ci(samples[a], samples[b])) for a, b in pairs if a in samples and b in samples}


def round_estimates(samples: dict[str, list[float]], run_length: int, pairs: Iterable[tuple[str, str]]) -> dict:
    """:func:`medians` (``median_s``) and :func:`ratios` (``ratios``) of per-call samples kept flat in rounds of
    ``run_length`` calls (:func:`timed_rounds`), each round resampled whole."""
    runs = {name: in_runs(values, run_length) for name, values in samples.items()}
    return {"median_s": medians(runs), "ratios": ratios(runs, pairs)}


def verdict(estimate: Estimate | dict[str, float] | float, target: float, at_most: bool = True) -> Verdict:
    """``met`` / ``missed`` only when the whole 95 % CI (a plain number: itself) is on one side of ``target``."""
    e = asdict(estimate) if isinstance(estimate, Estimate) else estimate
    low, high = (e["low"], e["high"]) if isinstance(e, dict) else (e, e)
    met, missed = (high <= target, low > target) if at_most else (low >= target, high < target)
    return "met" if met else "missed" if missed else "undecided"


def make_record(
    benchmark: str, config: dict[str, Any], quiet: Quietness, argv: Sequence[str] | None = None, **sections: Any
) -> dict[str, Any]:
    """The one JSON schema: what ran (``argv``, default the command line), on what, how quiet, then ``sections``."""
    args = sys.argv[1:] if argv is None else list(argv)
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "command": ("python -m benchmarks." + benchmark + " " + shlex.join(map(str, args))).strip(),
        "config": config,
        "environment": environment(),
        "quietness": quiet.as_dict(),
        **sections,
    }
