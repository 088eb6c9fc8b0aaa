"""SyncedDataParallel on 2-3 ranks: parity with one process, gradients when backward returns, communication
counts. In one process (bucket layout, options): ``tests/gradients/test_grad_sync_one_process.py``."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from collectives.launcher import run_workers
from parallel.gradients.grad_sync import SyncedDataParallel
from parallel.host.host_reduce import parse_launch_label
from parallel.sync_config import SYNC_MODES

# A few hundred bytes per bucket: the small test nets still split into several buckets.
_SMALL_BUCKETS = {"bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.0005}
_WORLD_SIZE = 2
_STEPS = 3
_TRANSPORTS = ("process_group", "shared_memory")  # "auto" is shared_memory here (CPU, one host)


class _Net(nn.Module):
    """MLP with a tied weight, a frozen layer, a branch few micro-batches use, and a dead layer."""

    def __init__(self) -> None:
        super().__init__()
        # Registered first, so they land in the last buckets (reverse registration order).
        self.branch = nn.Linear(16, 16)
        self.never_used = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.inp = nn.Linear(8, 16)
        self.hidden = nn.Linear(16, 16)
        self.tied = nn.Linear(16, 16)
        self.tied.weight = self.hidden.weight
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.tied(torch.tanh(self.hidden(h))))
        h = torch.tanh(self.frozen(h))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.out(h)


def _batches(step: int, world_size: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world_size, k, 5, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(world_size, k, 5, 4, generator=gen, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def _uses_branch(step: int, rank: int, micro_batch: int, k: int) -> bool:
    # Step 0: rank 0's first micro-batch only (with k > 1 that gradient is accumulated under
    # no_sync and absent from the synced backward). Step 1: rank 1's last micro-batch only.
    # Step 2: nobody, so the branch must end with grad=None and no stale bucket contents.
    return (step, rank, micro_batch) in ((0, 0, 0), (1, 1, k - 1))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _snapshot(net: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    return {
        name: (p.detach().cpu().clone(), None if p.grad is None else p.grad.detach().cpu().clone())
        for name, p in net.named_parameters()
    }


def _train_synced(
    rank: int,
    world_size: int,
    mode: str,
    k: int,
    dtype: torch.dtype,
    options: dict,
    device: str = "cpu",
    call_finish: bool = True,
) -> dict:
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU: every rank on it
    torch.manual_seed(100 + rank)  # ranks start different: the initial broadcast must fix it
    net = _Net().to(device=device, dtype=dtype)
    model = SyncedDataParallel(net, mode=mode, **_SMALL_BUCKETS, **options)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(_STEPS):
        optimizer.zero_grad()  # set_to_none: the bucket views must come back
        x, y = (t.to(device) for t in _batches(step, world_size, k, dtype))
        for j in range(k):
            with model.no_sync() if j < k - 1 else contextlib.nullcontext():
                out = model(x[rank, j], _uses_branch(step, rank, j, k))
                (_loss(out, y[rank, j]) / k).backward()
        grads = _snapshot(net)  # as backward returned: what on_after_backward reads
        if call_finish:
            model.finish()  # a no-op now; it must not change anything
            assert _snapshot(net).keys() == grads.keys()
            for name, (_, grad) in _snapshot(net).items():
                assert (grad is None) == (grads[name][1] is None) and (
                    grad is None or torch.equal(grad, grads[name][1])
                )
        optimizer.step()
    return {name: (param, grads[name][1]) for name, (param, _) in _snapshot(net).items()}


def _train_reference(world_size: int, k: int) -> dict:
    """Single process, float64, on the concatenation of every rank's micro-batches."""
    torch.manual_seed(100)
    net = _Net().double()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(_STEPS):
        optimizer.zero_grad()
        x, y = _batches(step, world_size, k, torch.float64)
        losses = [
            _loss(net(x[r, j], _uses_branch(step, r, j, k)), y[r, j]) for r in range(world_size) for j in range(k)
        ]
        torch.stack(losses).mean().backward()
        grads = _snapshot(net)
        optimizer.step()
    return {name: (p.detach().clone(), grads[name][1]) for name, p in net.named_parameters()}


def _assert_close_to_reference(result: dict, reference: dict, atol: float, rtol: float = 0.0):
    assert result.keys() == reference.keys()
    for name, (param, grad) in result.items():
        ref_param, ref_grad = reference[name]
        close = {"atol": atol, "rtol": rtol}
        torch.testing.assert_close(param.double(), ref_param, **close, msg=f"param {name}")
        assert (grad is None) == (ref_grad is None), f"grad of {name}: {grad} vs {ref_grad}"
        if grad is not None:
            torch.testing.assert_close(grad.double(), ref_grad, **close, msg=f"grad {name}")


@pytest.mark.distributed
@pytest.mark.parametrize("transport", _TRANSPORTS)
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("mode", SYNC_MODES)
def test_two_rank_training_matches_single_process(tmp_path, mode, k, transport):
    options = {"grad_transport": transport}
    results = run_workers(
        _train_synced, _WORLD_SIZE, args=(mode, k, torch.float64, options), init_file=tmp_path / "store"
    )
    reference = _train_reference(_WORLD_SIZE, k)
    # Unused everywhere -> None; used by one rank only -> averaged on both; frozen -> None.
    assert reference["never_used.weight"][1] is None and reference["branch.weight"][1] is None
    for result in results:
        _assert_close_to_reference(result, reference, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("transport", _TRANSPORTS)
@pytest.mark.parametrize("mode", SYNC_MODES)
def test_gradients_are_rank_averages_when_backward_returns(tmp_path, mode, transport):
    # No finish() at all: the average must be in p.grad when backward() returns, every run the
    # same bits (no read races an all-reduce still writing the buffer).
    options = {"grad_transport": transport}
    runs = [
        run_workers(
            _train_synced,
            _WORLD_SIZE,
            args=(mode, 2, torch.float64, options, "cpu", False),
            init_file=tmp_path / f"store{i}",
        )
        for i in range(3)
    ]
    reference = _train_reference(_WORLD_SIZE, 2)
    for results in runs:
        for result in results:
            _assert_close_to_reference(result, reference, atol=1e-6)
            for name, (param, grad) in result.items():
                same = runs[0][0][name]
                assert torch.equal(param, same[0]) and (grad is None or torch.equal(grad, same[1])), name


def _gradients_in_buckets(rank: int, world_size: int) -> list[bool]:
    """Per step: every gradient lies inside a bucket buffer (set_to_none each step: the views come back)."""
    net = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    model = SyncedDataParallel(net, **_SMALL_BUCKETS)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    inside = []
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(3, 6)).sum().backward()
        spans = [(b.buffer.data_ptr(), b.buffer.numel() * b.buffer.element_size()) for b in model.buckets]
        inside.append(all(any(lo <= p.grad.data_ptr() < lo + n for lo, n in spans) for p in net.parameters()))
        optimizer.step()
    return inside


@pytest.mark.distributed
def test_gradients_are_views_into_the_buckets_across_steps(tmp_path):
    assert run_workers(_gradients_in_buckets, _WORLD_SIZE, init_file=tmp_path / "store") == [[True, True]] * 2


@pytest.mark.distributed
@pytest.mark.parametrize("transport", _TRANSPORTS)
def test_three_ranks_match_single_process(tmp_path, transport):
    args = ("bucketed", 2, torch.float64, {"grad_transport": transport})
    results = run_workers(_train_synced, 3, args=args, init_file=tmp_path / "store")
    reference = _train_reference(3, 2)
    for result in results:
        _assert_close_to_reference(result, reference, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("dtype", "options", "atol"),
    [(torch.bfloat16, {}, 0.05), (torch.float64, {"grad_compression": "bf16"}, 0.02)],
    ids=["bf16-params", "bf16-compression"],
)
def test_bf16_gradients_stay_close_to_float64(tmp_path, dtype, options, atol):
    args = ("bucketed", 2, dtype, options)
    results = run_workers(_train_synced, _WORLD_SIZE, args=args, init_file=tmp_path / "store")
    reference = _train_reference(_WORLD_SIZE, 2)
    for result in results:
        _assert_close_to_reference(result, reference, atol=atol, rtol=0.05)
    # bf16 rounding must be identical on both ranks: replicas may not drift apart.
    for name, (param, _) in results[0].items():
        assert torch.equal(param, results[1][name][0]), name


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for NCCL")
def test_two_rank_nccl_training_matches_single_process(tmp_path):
    args = ("bucketed", 3, torch.float64, {}, "cuda")
    # spawn: CUDA cannot be re-initialised in a forked child.
    results = run_workers(
        _train_synced,
        _WORLD_SIZE,
        args=args,
        init_file=tmp_path / "store",
        backend="nccl",
        start_method="spawn",
        timeout_s=120,
    )
    reference = _train_reference(_WORLD_SIZE, 3)
    for result in results:
        _assert_close_to_reference(result, reference, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_ranks_sharing_one_gpu_over_gloo_match_single_process(tmp_path):
    """The CUDA path of the buckets on one GPU: gloo all-reduces CUDA tensors (host-staged)."""
    args = ("bucketed", 3, torch.float64, {}, "cuda")
    kwargs = {"init_file": tmp_path / "store", "start_method": "spawn", "timeout_s": 120}
    results = run_workers(_train_synced, _WORLD_SIZE, args=args, **kwargs)
    reference = _train_reference(_WORLD_SIZE, 3)
    for result in results:
        _assert_close_to_reference(result, reference, atol=1e-6)


def _allreduce_starts(prof) -> list[float]:
    """Start times of gradient all-reduces: gloo's, or launches of shared-memory ones."""
    return [
        e.time_range.start
        for e in prof.events()
        if e.name == "c10d::allreduce_" or parse_launch_label(e.name) is not None
    ]


def _count_in_backward_and_finish(model: SyncedDataParallel, x: torch.Tensor) -> tuple[int, int]:
    """All-reduces launched during backward and during finish(), from ONE profiler window.

    The window must cover the waits too: stopping the profiler while gloo work it recorded is
    still in flight corrupts the heap (torch 2.14).
    """
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
        with record_function("finish"):
            model.finish()
    (window,) = [e.time_range for e in prof.events() if e.name == "finish"]
    starts = _allreduce_starts(prof)
    in_finish = sum(window.start <= t <= window.end for t in starts)
    return len(starts) - in_finish, in_finish


def _comm_counts(rank: int, world_size: int, mode: str, k: int, transport: str) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]).double()
    model = SyncedDataParallel(net, mode=mode, **_SMALL_BUCKETS, grad_transport=transport)
    assert model.grad_transport == transport
    x = torch.randn(k, 4, 16, dtype=torch.float64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for j in range(k - 1):
            with model.no_sync():
                model(x[j]).sum().backward()
                model.finish()  # must be a no-op in here
    during_no_sync = len(_allreduce_starts(prof))
    during_backward, in_finish = _count_in_backward_and_finish(model, x[-1])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.finish()
    return {
        "no_sync": during_no_sync,
        "backward": during_backward,
        "finish": in_finish,
        "finish_again": len(_allreduce_starts(prof)),
        "buckets": len(model.buckets),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("transport", _TRANSPORTS)
@pytest.mark.parametrize("mode", SYNC_MODES)
def test_accumulation_communicates_once_per_bucket_on_the_last_micro_batch(tmp_path, mode, transport):
    counts = run_workers(_comm_counts, _WORLD_SIZE, args=(mode, 3, transport), init_file=tmp_path / "store")[0]
    buckets = counts["buckets"]
    assert buckets == 1 if mode == "flat" else buckets > 1
    # Overlapped modes launch from the gradient hooks, the others from the end-of-backward callback:
    # either way every all-reduce runs before backward() returns, and finish() has nothing left.
    assert counts == {
        "no_sync": 0,
        "backward": buckets,
        "finish": 0,
        "finish_again": 0,
        "buckets": buckets,
    }
