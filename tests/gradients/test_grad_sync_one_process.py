"""SyncedDataParallel in one process (no process group: world size 1, so nothing to average and no bucket): bucket
assignment and its description, gradients left as autograd made them, parity with plain training, option errors.
On 2-3 ranks: ``tests/gradients/test_grad_sync.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallel.gradients.buckets import assign_buckets, build_buckets, describe_buckets
from parallel.gradients.grad_sync import SyncedDataParallel
from parallel.sync_config import GradSyncConfig

# A few hundred bytes per bucket: the small test nets still split into several buckets.
_SMALL_BUCKETS = {"bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.0005}


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("bucketed", [[0], [1, 3], [2], [4, 5]]),  # small first bucket per dtype, then the cap
        ("flat", [[0, 1, 3, 4, 5], [2]]),  # one bucket per dtype
        ("per_param", [[0], [1], [2], [3], [4], [5]]),
    ],
)
def test_bucket_assignment_follows_caps_and_separates_dtypes(mode, expected):
    f32, f64 = torch.zeros(256), torch.zeros(128, dtype=torch.float64)  # 1 KiB each
    params = [f32, f32.clone(), f64, f32.clone(), f32.clone(), f32.clone()]
    caps = GradSyncConfig(mode, bucket_cap_mb=2048 / 2**20, first_bucket_cap_mb=1000 / 2**20).caps()
    assert assign_buckets(params, *caps) == expected


def test_one_rank_installs_no_bucket_and_leaves_gradients_where_autograd_puts_them():
    """Nothing to average: no bucket, no hook, no copy (a launch-bound GPU step paid ~1 ms for them)."""
    net = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    model = SyncedDataParallel(net, **_SMALL_BUCKETS)  # no process group: world size 1
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(3, 6)).sum().backward()
        model.finish()
        assert model.buckets == ()
        assert all(p.grad is not None and p.grad._base is None for p in net.parameters())  # not bucket views
        optimizer.step()


def test_world_size_one_without_process_group_matches_plain_training():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    wrapped_net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    wrapped_net.load_state_dict(plain.state_dict())
    model = SyncedDataParallel(wrapped_net)
    assert model.world_size == 1
    x = torch.randn(4, 6, dtype=torch.float64)
    plain(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    model.finish()
    for p, q in zip(plain.parameters(), wrapped_net.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=0.0, rtol=0.0)


def test_two_synced_backward_passes_in_one_step_add_up_as_in_one_process():
    torch.manual_seed(0)
    plain, wrapped_net = nn.Linear(4, 4), nn.Linear(4, 4)
    wrapped_net.load_state_dict(plain.state_dict())
    model = SyncedDataParallel(wrapped_net)
    for x in (torch.randn(2, 4), torch.randn(3, 4)):
        plain(x).pow(2).sum().backward()
        model(x).pow(2).sum().backward()
    for p, q in zip(plain.parameters(), wrapped_net.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=0.0, rtol=0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "ring"}, "mode='ring'"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb=0"),
        ({"first_bucket_cap_mb": -1.0}, "first_bucket_cap_mb=-1.0"),
        ({"grad_compression": "fp8"}, "grad_compression='fp8'"),
    ],
)
def test_bad_options_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyncedDataParallel(nn.Linear(2, 2), **kwargs)


def test_bucket_layout_names_the_parameters_last_layer_first(caplog):
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    params = list(net.parameters())[::-1]  # the order GradReducer buckets them in
    text = describe_buckets(build_buckets(params, assign_buckets(params, 0.0003, 0.0001)), net)
    assert "bucket 0:" in text and "bucket 1:" in text
    assert text.index("2.bias") < text.index("0.weight")  # parameters are named, last layer first
    with caplog.at_level("DEBUG", logger="parallel.gradients.reducer"):
        SyncedDataParallel(net, **_SMALL_BUCKETS)
    (record,) = [r for r in caplog.records if r.name == "parallel.gradients.reducer"]
    assert "world_size=1): nothing to average, no buckets" in record.getMessage()  # 2-rank layouts: test_grad_sync


def test_a_lazy_module_is_refused_by_name_until_a_forward_initialises_it():
    net = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"0\.weight, 0\.bias not initialised.*one forward pass"):
        SyncedDataParallel(net)
    net(torch.zeros(1, 3))  # the documented fix
    model = SyncedDataParallel(net)
    model(torch.zeros(1, 3)).sum().backward()
    assert net[0].weight.grad is not None
