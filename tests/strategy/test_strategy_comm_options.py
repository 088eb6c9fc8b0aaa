"""custom_ddp's communication options: ``grad_compression``, ``first_bucket_cap_mb``, ``syncbn_group_size``,
``syncbn_compile``.

From the command line to the strategy and its ``options`` record, checked with errors that name
the fix; compressed gradients on 2 gloo ranks against the fp32 path (equal up to the wire dtype's
rounding, half the bytes); SyncBatchNorm in groups of 2 on 4 ranks against BatchNorm on each
group's concatenated batch.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import train  # train.py at the repository root, on pytest's pythonpath
from callbacks.run_hparams import flatten_hparams
from collectives.launcher import WorkerError, run_workers
from measure.collective_count import count_collectives
from measure.run_info import strategy_options
from parallel.gradients.grad_sync import SyncedDataParallel
from strategies import CustomDDPStrategy
from strategies.training.layer_sync import CustomSyncBatchNorm

_UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def _plugin_for_fit(strategy: CustomDDPStrategy) -> Any:
    """The LayerSync plugin the strategy's setup installs when fitting."""
    return strategy._batchnorm_sync.plugin(strategy._layer_sync)


def test_options_from_the_command_line_reach_the_strategy_and_its_record() -> None:
    cli = train.main(
        [
            "--config",
            "configs/quickstart.yaml",
            "--trainer.strategy=custom_ddp_fork",
            "--trainer.strategy.grad_compression=bf16",
            "--trainer.strategy.first_bucket_cap_mb=0.5",
            "--trainer.strategy.syncbn_group_size=2",
            "--trainer.strategy.syncbn_compile=true",
        ],
        run=False,
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, CustomDDPStrategy)
    keys = ("grad_compression", "first_bucket_cap_mb", "syncbn_group_size", "syncbn_compile")
    assert {key: getattr(strategy.options, key) for key in keys} == {
        "grad_compression": "bf16",
        "first_bucket_cap_mb": 0.5,
        "syncbn_group_size": 2,
        "syncbn_compile": True,
    }


def test_options_are_recorded_as_hyperparameters_and_in_benchmark_records() -> None:
    # strategy_options feeds RunHparams (TensorBoard HPARAMS) and BenchmarkMonitor's records.
    options = strategy_options(CustomDDPStrategy(grad_compression="fp16", syncbn_group_size=2, first_bucket_cap_mb=1))
    flat = flatten_hparams(options, prefix="strategy/")
    assert {
        key: flat[f"strategy/{key}"] for key in ("grad_compression", "first_bucket_cap_mb", "syncbn_group_size")
    } == {"grad_compression": "fp16", "first_bucket_cap_mb": 1.0, "syncbn_group_size": 2}
    assert (
        flatten_hparams(strategy_options(CustomDDPStrategy()), prefix="strategy/")["strategy/grad_compression"]
        == "None"
    )


def test_defaults_are_torch_ddps_except_the_first_bucket_on_gloo() -> None:
    options = CustomDDPStrategy().options
    assert (options.grad_compression, options.first_bucket_cap_mb, options.syncbn_group_size) == (None, None, None)
    # The first bucket by backend: torch DDP's 1 MiB on NCCL; as large as the others on gloo, where
    # the reduction shares the CPU cores with backward (an early start hides nothing).
    assert options.grad_sync.caps("nccl") == (25.0, 1.0)
    assert options.grad_sync.caps("gloo") == (25.0, 25.0)
    assert CustomDDPStrategy(first_bucket_cap_mb=0.5).options.grad_sync.caps("gloo") == (25.0, 0.5)
    assert options.broadcast_buffers is True  # DDP's broadcast_buffers default
    assert options.syncbn_compile is False  # the eager kernel unless asked: a first compile takes ~20 s


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grad_compression": "fp8"}, "grad_compression='fp8' must be None or one of ('bf16', 'fp16')"),
        ({"first_bucket_cap_mb": 0}, "first_bucket_cap_mb=0 must be a number > 0"),
        ({"first_bucket_cap_mb": "1"}, "first_bucket_cap_mb='1' must be a number > 0"),
        ({"syncbn_group_size": 0}, "syncbn_group_size=0 must be None (all ranks) or an int >= 1"),
        ({"syncbn_group_size": True}, "syncbn_group_size=True must be None"),
        ({"syncbn_group_size": 2, "sync_batchnorm": False}, "syncbn_group_size=2 needs sync_batchnorm=True"),
        ({"broadcast_buffers": "yes"}, "broadcast_buffers='yes' must be a bool"),
        ({"syncbn_compile": "yes"}, "syncbn_compile='yes' must be a bool"),
        ({"syncbn_compile": True, "sync_batchnorm": False}, "syncbn_compile=True needs sync_batchnorm=True"),
        ({"static_graph": "yes"}, "static_graph='yes' must be a bool or None (torch DDP's flag, accepted from a ddp"),
    ],
)
def test_bad_options_name_the_value_and_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^CustomDDPStrategy: .*" + message.replace("(", r"\(").replace(")", r"\)")):
        CustomDDPStrategy(**kwargs)


def test_gradient_options_reach_the_gradient_sync() -> None:
    strategy = CustomDDPStrategy(grad_compression="fp16", first_bucket_cap_mb=1e-6, bucket_cap_mb=1000)
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model = strategy._setup_model(net)
    assert isinstance(model, SyncedDataParallel) and model.grad_compression == "fp16"
    assert (model.config.bucket_cap_mb, model.config.first_bucket_cap_mb) == (1000.0, 1e-6)
    assert model.buckets == ()  # one process: nothing to average, so no bucket (2-rank layouts: test_grad_sync)


# ---------------------------------------------------------------------- compressed gradients, 2 ranks


def _synced_gradients(rank: int, world_size: int, compression: str | None) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    local = copy.deepcopy(net)
    # Two buckets, so that more than one all-reduce is compressed.
    model = SyncedDataParallel(net, grad_compression=compression, bucket_cap_mb=1e-3, first_bucket_cap_mb=1e-4)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 + rank))
    local(x).square().sum().backward()
    with count_collectives(model) as collectives:
        model(x).square().sum().backward()
        model.finish()
    return {
        "synced": {name: p.grad.clone() for name, p in net.named_parameters()},
        "local": {name: p.grad.clone() for name, p in local.named_parameters()},
        "bucket_bytes": [c.bytes for c in collectives if c.source == "grad_buckets"],
    }


@pytest.mark.distributed
@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compressed_gradients_equal_the_fp32_path_to_the_wire_dtypes_rounding(tmp_path, compression: str) -> None:
    exact = run_workers(_synced_gradients, 2, args=(None,), init_file=tmp_path / "fp32")
    compressed = run_workers(_synced_gradients, 2, args=(compression,), init_file=tmp_path / "compressed")

    unit = _UNIT_ROUNDOFF[compression]
    for name, reference in exact[0]["synced"].items():
        got = compressed[0]["synced"][name]
        assert torch.equal(got, compressed[1]["synced"][name]), name  # replicas stay identical
        # Each rank's pre-divided gradient rounds once to the wire dtype, their sum once more:
        # |error| <= 2u (|g_0| + |g_1|) / 2, u the wire dtype's unit roundoff (plus fp32's own).
        magnitude = (compressed[0]["local"][name].abs() + compressed[1]["local"][name].abs()) / 2
        bound = (2 * unit * (1 + unit) + 2.0**-22) * magnitude + 1e-30
        error = (got - reference).abs()
        assert (error <= bound).all(), (name, (error - bound).max())
    errors = [(compressed[0]["synced"][n] - r).abs().max() for n, r in exact[0]["synced"].items()]
    assert max(errors) > 0  # the wire dtype really rounded something
    # Half the bytes for every gradient bucket (its used-flags travel compressed too).
    assert [2 * b for b in compressed[0]["bucket_bytes"]] == exact[0]["bucket_bytes"]
    assert len(exact[0]["bucket_bytes"]) == 2


# ---------------------------------------------------------------------- SyncBN in groups of consecutive ranks

_SIZES = (3, 5, 2, 6)  # local batch of ranks 0..3; groups {0, 1} and {2, 3}
_CHANNELS = 4


def _group_batches() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(sum(_SIZES), _CHANNELS, 3, 3, generator=generator)
    x[sum(_SIZES[:2]) :] = 5.0 + 3.0 * x[sum(_SIZES[:2]) :]  # the second group's statistics differ
    return x, torch.randn(x.shape, generator=generator)


def _rows(rank: int) -> slice:
    return slice(sum(_SIZES[:rank]), sum(_SIZES[: rank + 1]))


def _grouped_syncbn(rank: int, world_size: int) -> dict:
    plugin = _plugin_for_fit(CustomDDPStrategy(syncbn_group_size=2))
    net = plugin.apply(nn.Sequential(nn.BatchNorm2d(_CHANNELS)))
    x, grad = _group_batches()
    x = x[_rows(rank)].clone().requires_grad_()
    out = net(x)
    out.backward(grad[_rows(rank)])
    layer = net[0]
    return {
        "ranks": dist.get_process_group_ranks(plugin.process_group),
        "out": out.detach(),
        "grad": x.grad,
        "weight_grad": layer.weight.grad,
        "running_mean": layer.running_mean,
        "running_var": layer.running_var,
    }


@pytest.mark.distributed
def test_syncbn_in_groups_of_two_equals_batchnorm_on_each_groups_batch(tmp_path) -> None:
    results = run_workers(_grouped_syncbn, 4, init_file=tmp_path / "store")

    x, grad = _group_batches()
    for group in ((0, 1), (2, 3)):
        assert [results[r]["ranks"] for r in group] == [list(group)] * 2
        rows = slice(_rows(group[0]).start, _rows(group[1]).stop)
        reference = nn.BatchNorm2d(_CHANNELS)
        inputs = x[rows].clone().requires_grad_()
        expected = reference(inputs)
        expected.backward(grad[rows])
        torch.testing.assert_close(torch.cat([results[r]["out"] for r in group]), expected.detach())
        torch.testing.assert_close(torch.cat([results[r]["grad"] for r in group]), inputs.grad)
        torch.testing.assert_close(sum(results[r]["weight_grad"] for r in group), reference.weight.grad)
        for r in group:
            torch.testing.assert_close(results[r]["running_mean"], reference.running_mean)
            torch.testing.assert_close(results[r]["running_var"], reference.running_var)
    # And not the world's statistics: the two groups' running means differ.
    assert (results[0]["running_mean"] - results[2]["running_mean"]).abs().min() > 0.1


def _group_size_three(rank: int, world_size: int) -> None:
    _plugin_for_fit(CustomDDPStrategy(syncbn_group_size=3))


@pytest.mark.distributed
def test_group_size_that_does_not_divide_the_world_fails_on_every_rank(tmp_path) -> None:
    with pytest.raises(WorkerError) as failure:
        run_workers(_group_size_three, 2, init_file=tmp_path / "store")
    message = str(failure.value)
    assert "rank 0" in message and "rank 1" in message
    assert "syncbn_group_size=3 must divide the world size 2" in message and "use one of [1, 2]" in message


def test_group_size_and_a_syncbn_plugin_together_are_refused() -> None:
    strategy = CustomDDPStrategy(syncbn_group_size=2)
    strategy._layer_sync = CustomSyncBatchNorm()
    with pytest.raises(ValueError, match="syncbn_group_size=2 and the plugin CustomSyncBatchNorm both"):
        _plugin_for_fit(strategy)


def test_syncbn_compile_converts_to_compiled_layers_and_refuses_a_plugin_beside_it() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    plugin = _plugin_for_fit(CustomDDPStrategy(syncbn_compile=True))
    assert plugin.compile and plugin.apply(net)[1].compile_kernel
    assert not _plugin_for_fit(CustomDDPStrategy()).compile
    strategy = CustomDDPStrategy(syncbn_compile=True)
    strategy._layer_sync = CustomSyncBatchNorm()
    with pytest.raises(ValueError, match="syncbn_compile=True and the plugin CustomSyncBatchNorm both"):
        _plugin_for_fit(strategy)
