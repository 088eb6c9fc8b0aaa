"""The assignment's SyncBatchNorm test: every worker's shard vs BatchNorm1d on the global batch.

Grid: ``num_workers`` in {1, 4} x ``hid_dim`` in {128, 256, 512, 1024} x ``batch_size`` (per
worker) in {32, 64}. Inputs are standard normal fp32; the loss is the sum over all dimensions of
the FIRST B/2 samples of the global batch (B = batch_size * num_workers), so with 4 workers only
ranks 0 and 1 contribute to it, yet every rank's input gradient is non-zero through the shared
statistics. Outputs and input gradients must match ``torch.nn.BatchNorm1d`` run on the
concatenated batch within ``atol=1e-3, rtol=0``.
"""

import warnings

import pytest
import torch

import parallel.batchnorm.syncbn
from collectives.launcher import run_workers
from parallel.batchnorm.syncbn import SyncBatchNorm
from parallel.batchnorm.syncbn_kernels import compiled_kernels

pytestmark = pytest.mark.distributed

_SEED = 1234


def _global_batch(num_workers: int, hid_dim: int, batch_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(_SEED + hid_dim + batch_size)
    return torch.randn(num_workers * batch_size, hid_dim, generator=generator)


def _grid_worker(rank: int, world_size: int, hid_dim: int, batch_size: int, compile: bool):
    if compile:  # (N, C) inputs: the compiled passes only run with a set that compiles every shape
        parallel.batchnorm.syncbn.COMPILED_KERNELS = compiled_kernels(min_elements=0, spatial_only=False)
        warnings.filterwarnings("error", message=r"SyncBatchNorm\(compile=True\): torch.compile failed")
    global_batch = _global_batch(world_size, hid_dim, batch_size)
    first = rank * batch_size
    local = global_batch[first : first + batch_size].clone().requires_grad_()
    out = SyncBatchNorm(hid_dim, compile=compile, force_sync=True)(local)  # the kernel on 1 rank too
    # This rank's rows among the first B/2 global rows (none on ranks 2 and 3 of 4); every
    # rank still runs backward, which joins the backward collective.
    rows_in_loss = min(max(world_size * batch_size // 2 - first, 0), batch_size)
    out[:rows_in_loss].sum().backward()
    return out.detach(), local.grad


_COMPILED_SUBSET = [
    pytest.param(4, hid_dim, 32, True, id=f"4-{hid_dim}-32-compiled", marks=pytest.mark.slow) for hid_dim in (128, 1024)
]


@pytest.mark.parametrize(
    ("num_workers", "hid_dim", "batch_size", "compile"),
    [
        *(
            pytest.param(w, h, b, False, id=f"{w}-{h}-{b}")
            for w in (1, 4)
            for h in (128, 256, 512, 1024)
            for b in (32, 64)
        ),
        *_COMPILED_SUBSET,
    ],
)
def test_shards_match_batchnorm1d_on_the_global_batch(tmp_path, num_workers, hid_dim, batch_size, compile):
    results = run_workers(
        _grid_worker,
        num_workers,
        args=(hid_dim, batch_size, compile),
        init_file=tmp_path / "store",
        timeout_s=600.0 if compile else 60.0,  # compiling takes ~20 s cold, several times that under load
    )

    global_batch = _global_batch(num_workers, hid_dim, batch_size).requires_grad_()
    expected = torch.nn.BatchNorm1d(hid_dim)(global_batch)
    expected[: global_batch.shape[0] // 2].sum().backward()

    outputs = torch.cat([out for out, _ in results])
    input_grads = torch.cat([grad for _, grad in results])
    torch.testing.assert_close(outputs, expected.detach(), atol=1e-3, rtol=0)
    torch.testing.assert_close(input_grads, global_batch.grad, atol=1e-3, rtol=0)
    # The loss covers half the batch, so the gradient must not vanish anywhere.
    assert input_grads.abs().amax(dim=1).min() > 1e-3
