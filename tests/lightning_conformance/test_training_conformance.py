"""Training conformance: every pattern of ``conformance.training.patterns`` gives its truth under ``custom_ddp``.

2 CPU ranks (fork + gloo). The truth is one process on the global batch, or Lightning's ``ddp``
(rank 0's state: what its checkpoint holds) where per-rank state is part of the pattern. Every rank
of ``custom_ddp`` must hold that state (within float rounding) and the ranks must agree bitwise.
The same runs generate the training table of docs/training-conformance.md (``python -m conformance.training.table``).
"""

from __future__ import annotations

import pytest
import torch

from conformance.training.patterns import PATTERNS
from conformance.training.runs import compare, fit_pattern

pytestmark = pytest.mark.distributed
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}


def _params() -> list:
    # torch.compile rows take 10-60 s (the first compile of each rank): kept out of the default run.
    return [
        pytest.param(name, marks=pytest.mark.slow) if pattern.compiles else name for name, pattern in PATTERNS.items()
    ]


@pytest.mark.parametrize("name", _params())
def test_custom_ddp_trains_every_pattern_to_its_truth_with_identical_ranks(name: str) -> None:
    pattern = PATTERNS[name]
    run = fit_pattern(pattern, "custom_ddp")
    truth = (
        fit_pattern(pattern, "custom_ddp", interrupt=False)
        if pattern.truth == "uninterrupted"
        else fit_pattern(pattern, pattern.truth)
    )
    result = compare(run, truth)
    dtype = next(v.dtype for v in run[0]["state"].values() if v.is_floating_point())
    assert result["max_diff"] <= TOLERANCE[dtype], result
    assert result["ranks_agree"], result


def test_on_after_backward_sees_ddps_averaged_gradients_bitwise_every_run() -> None:
    pattern = PATTERNS["after_backward"]
    ddp = fit_pattern(pattern, "ddp")[0]["records"]["after_backward_grads"]
    runs = [fit_pattern(pattern, "custom_ddp") for _ in range(3)]
    first = runs[0][0]["records"]["after_backward_grads"]
    assert len(first) == len(ddp) == 4
    for step, grads in enumerate(first):
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ddp[step][name], rtol=1e-6, atol=1e-7, msg=f"step {step} {name}")
    for run in runs:
        for rank in run:
            seen = rank["records"]["after_backward_grads"]
            assert all(torch.equal(seen[s][n], first[s][n]) for s in range(len(first)) for n in first[s])


def test_a_non_batchnorm_buffer_holds_rank_0s_value_at_every_forward_as_under_ddp() -> None:
    pattern = PATTERNS["non_bn_buffer"]
    ddp = fit_pattern(pattern, "ddp")
    custom = fit_pattern(pattern, "custom_ddp")
    expected = ddp[0]["records"]["buffer_at_forward"]
    for rank in (*ddp, *custom):  # ddp broadcasts before every training forward too
        assert torch.equal(torch.stack(rank["records"]["buffer_at_forward"]), torch.stack(expected))
    # At the end of fit ddp's rank 1 keeps the value its own last forward made; custom_ddp's ranks agree.
    assert compare(custom, ddp)["ranks_agree"] and not compare(ddp, ddp)["ranks_agree"]
