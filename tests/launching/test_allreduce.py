"""Ring and butterfly all-reduce against dist.all_reduce and the fp64 mean, world sizes 1-5."""

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from collectives.allreduce import butterfly_all_reduce, ring_all_reduce
from collectives.launcher import run_workers

pytestmark = pytest.mark.distributed

ALL_REDUCES = {"ring": ring_all_reduce, "butterfly": butterfly_all_reduce}
DTYPES = (torch.float32, torch.float64)
# Shorter than, equal to, and not divisible by every world size 1-5, plus a "real" length.
LENGTHS = (0, 1, 2, 3, 7, 61, 1000, 1001)


def _rank_data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * numel + rank)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


def _average_every_case(rank: int, world_size: int) -> dict:
    """Run every (algorithm, dtype, length) case plus dist.all_reduce; return the results."""
    out = {}
    for dtype in DTYPES:
        for numel in LENGTHS:
            reference = _rank_data(rank, numel, dtype)
            dist.all_reduce(reference)
            out["all_reduce", dtype, numel] = reference / world_size
            for name, all_reduce in ALL_REDUCES.items():
                tensor = _rank_data(rank, numel, dtype)
                returned = all_reduce(tensor)
                assert returned is tensor, "must average in place and return its input"
                out[name, dtype, numel] = tensor
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_matches_all_reduce_and_fp64_mean_identically_on_every_rank(tmp_path, world_size):
    per_rank = run_workers(_average_every_case, world_size, init_file=tmp_path / "store")
    for dtype in DTYPES:
        for numel in LENGTHS:
            mean = torch.stack([_rank_data(r, numel, dtype).double() for r in range(world_size)])
            mean = mean.mean(dim=0)
            tol = 1e-6 if dtype == torch.float32 else 1e-13
            for name in ALL_REDUCES:
                result = per_rank[0][name, dtype, numel]
                assert result.dtype == dtype and result.shape == (numel,)
                for rank in range(1, world_size):
                    assert torch.equal(per_rank[rank][name, dtype, numel], result), (name, rank)
                torch.testing.assert_close(result.double(), mean, rtol=0, atol=tol)
                torch.testing.assert_close(result, per_rank[0]["all_reduce", dtype, numel], rtol=0, atol=tol)


def _non_contiguous_and_subgroups(rank: int, world_size: int) -> dict:
    out = {}
    for name, all_reduce in ALL_REDUCES.items():
        base = torch.arange(12.0).reshape(3, 4) + 100 * rank
        view = base.t()  # non-contiguous (4, 3) view of base
        all_reduce(view)
        out[name, "base"] = base
        # Two interleaved subgroups: group ranks differ from global ranks.
        evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
        tensor = torch.full((5,), float(rank))
        all_reduce(tensor, group=evens if rank % 2 == 0 else odds)
        out[name, "group"] = tensor
        with pytest.raises(ValueError, match="not a member"):
            all_reduce(tensor, group=odds if rank % 2 == 0 else evens)
    return out


def test_non_contiguous_views_and_subgroups(tmp_path):
    per_rank = run_workers(_non_contiguous_and_subgroups, 4, init_file=tmp_path / "store")
    for rank, out in enumerate(per_rank):
        for name in ALL_REDUCES:
            expected_base = torch.arange(12.0).reshape(3, 4) + 100 * 1.5
            torch.testing.assert_close(out[name, "base"], expected_base, rtol=0, atol=1e-5)
            group_mean = 1.0 if rank % 2 == 0 else 2.0
            assert torch.equal(out[name, "group"], torch.full((5,), group_mean)), (name, rank)


def _collective_names(rank: int, world_size: int) -> list[str]:
    tensor = torch.randn(1001)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ring_all_reduce(tensor)
        butterfly_all_reduce(tensor)
    return sorted({event.name for event in prof.events() if event.name.startswith("c10d::")})


def test_uses_point_to_point_messages_only(tmp_path):
    names = run_workers(_collective_names, 3, init_file=tmp_path / "store")[0]
    assert names, "profiler recorded no c10d events"
    assert set(names) <= {"c10d::send", "c10d::recv_"}, names


@pytest.mark.parametrize("all_reduce", ALL_REDUCES.values(), ids=ALL_REDUCES.keys())
def test_rejects_bad_input_with_a_fix(all_reduce):
    with pytest.raises(TypeError, match="floating-point"):
        all_reduce(torch.arange(4))
    with pytest.raises(TypeError, match="torch.Tensor"):
        all_reduce([1.0, 2.0])
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        all_reduce(torch.ones(3))
