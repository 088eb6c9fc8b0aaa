"""Which of Lightning's tests run (paths relative to its ``tests/`` folder), and the known differences.

Files: every ``tests_pytorch`` file with a test that names a ddp strategy and can run on CPU. In each,
the tests :func:`k_expression` selects run in both modes: those :data:`K_EXPRESSION` matches by name
(ddp, process start methods, distributed features, strategies) and those of :data:`NAMED_IN_SOURCE`,
whose names miss it though their code or parameters name a ddp strategy (found by reading every test's
source at 2.6.5). Left out, by reason: :data:`LEFT_OUT`.

Standalone tests: Lightning marks tests that launch popen ranks (which re-run the whole pytest command)
``RunIf(standalone=True)``; outside ``PL_RUN_STANDALONE_TESTS=1`` they are skipped, and Lightning's CI
runs each in a pytest of its own (``tests_pytorch/run_standalone_tasks.sh``). :data:`STANDALONE` holds
those of the selected files that run without a GPU (Lightning 2.6.5; the others need CUDA).
"""

from __future__ import annotations

__all__ = ["EXPECTED_DIFFERENCES", "FILES", "K_EXPRESSION", "LEFT_OUT", "QUICK_FILES", "QUICK_STANDALONE"]
__all__ += ["NAMED_IN_SOURCE", "STANDALONE", "expected_difference", "k_expression"]

K_EXPRESSION = "ddp or spawn or fork or distributed or strategy"

FILES = (
    "tests_pytorch/accelerators/test_common.py",
    "tests_pytorch/callbacks/progress/test_tqdm_progress_bar.py",
    "tests_pytorch/callbacks/test_early_stopping.py",
    "tests_pytorch/callbacks/test_pruning.py",
    "tests_pytorch/callbacks/test_spike.py",
    "tests_pytorch/callbacks/test_stochastic_weight_avg.py",
    "tests_pytorch/callbacks/test_weight_averaging.py",
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py",
    "tests_pytorch/checkpointing/test_model_checkpoint.py",
    "tests_pytorch/checkpointing/test_torch_saving.py",
    "tests_pytorch/core/test_metric_result_integration.py",
    "tests_pytorch/loggers/test_all.py",
    "tests_pytorch/loops/test_prediction_loop.py",
    "tests_pytorch/models/test_amp.py",
    "tests_pytorch/models/test_cpu.py",
    "tests_pytorch/models/test_hooks.py",
    "tests_pytorch/models/test_restore.py",
    "tests_pytorch/overrides/test_distributed.py",
    "tests_pytorch/plugins/precision/test_double.py",
    "tests_pytorch/plugins/test_amp_plugins.py",
    "tests_pytorch/plugins/test_cluster_integration.py",
    "tests_pytorch/profilers/test_profiler.py",
    "tests_pytorch/strategies/launchers/test_multiprocessing.py",
    "tests_pytorch/strategies/launchers/test_subprocess_script.py",
    "tests_pytorch/strategies/test_common.py",
    "tests_pytorch/strategies/test_ddp.py",
    "tests_pytorch/strategies/test_ddp_integration.py",
    "tests_pytorch/strategies/test_ddp_integration_comm_hook.py",
    "tests_pytorch/strategies/test_registry.py",
    "tests_pytorch/test_cli.py",
    "tests_pytorch/trainer/connectors/test_accelerator_connector.py",
    "tests_pytorch/trainer/connectors/test_data_connector.py",
    "tests_pytorch/trainer/flags/test_overfit_batches.py",
    "tests_pytorch/trainer/logging_/test_distributed_logging.py",
    "tests_pytorch/trainer/logging_/test_train_loop_logging.py",
    "tests_pytorch/trainer/optimization/test_manual_optimization.py",
    "tests_pytorch/trainer/optimization/test_optimizers.py",
    "tests_pytorch/trainer/properties/test_estimated_stepping_batches.py",
    "tests_pytorch/trainer/properties/test_get_model.py",
    "tests_pytorch/trainer/test_dataloaders.py",
    "tests_pytorch/trainer/test_trainer.py",
    "tests_pytorch/tuner/test_lr_finder.py",
    "tests_pytorch/tuner/test_scale_batch_size.py",
    "tests_pytorch/tuner/test_tuning.py",
    "tests_pytorch/utilities/test_all_gather_grad.py",
    "tests_pytorch/utilities/test_combined_loader.py",
    "tests_pytorch/utilities/test_compile.py",
    "tests_pytorch/utilities/test_dtype_device_mixin.py",
)

LEFT_OUT = {
    "needs a GPU or TPU": (
        "tests_pytorch/accelerators/test_xla.py",
        "tests_pytorch/models/test_ddp_fork_amp.py",
        "tests_pytorch/models/test_gpu.py",
        "tests_pytorch/models/test_onnx.py",  # its one ddp test needs 2 GPUs
        "tests_pytorch/models/test_torch_tensorrt.py",  # the same
    ),
    "FSDP, DeepSpeed and model parallelism: other strategies": (
        "tests_pytorch/strategies/test_deepspeed.py",
        "tests_pytorch/strategies/test_fsdp.py",
        "tests_pytorch/strategies/test_model_parallel_integration.py",
    ),
    "constructs DDPStrategy(...) itself (no registry name to swap)": (
        "tests_pytorch/core/test_results.py",
        "tests_pytorch/trainer/test_ddp_sigterm_handling.py",
    ),
    "imports requests and fastapi (Lightning's serve extra), not ddp": (
        "tests_pytorch/serve/test_servable_module_validator.py",
    ),
    "deprecation shims only": ("tests_pytorch/deprecated_api/test_no_removal_version.py",),
}

NAMED_IN_SOURCE = {
    "tests_pytorch/accelerators/test_common.py": ("test_pluggable_accelerator",),
    "tests_pytorch/callbacks/test_early_stopping.py": ("test_multiple_early_stopping_callbacks",),
    "tests_pytorch/callbacks/test_spike.py": ("test_trainer_spike_detection_integration",),
    "tests_pytorch/checkpointing/test_model_checkpoint.py": ("test_model_checkpoint_no_extraneous_invocations",),
    "tests_pytorch/core/test_metric_result_integration.py": ("test_result_collection_reload",),
    "tests_pytorch/loggers/test_all.py": ("test_logger_initialization",),
    "tests_pytorch/loops/test_prediction_loop.py": ("test_prediction_loop_batch_sampler_set_epoch_called",),
    "tests_pytorch/models/test_amp.py": ("test_amp_cpus",),
    "tests_pytorch/strategies/launchers/test_multiprocessing.py": (
        "test_fit_twice_raises",
        "test_memory_sharing_disabled",
    ),
    "tests_pytorch/strategies/test_common.py": ("test_evaluate",),
    "tests_pytorch/trainer/connectors/test_accelerator_connector.py": (
        "test_custom_cluster_environment_in_slurm_environment",
        "test_interactive_incompatible_backend_error",
        "test_sync_batchnorm_set",
        "test_torchelastic_priority_over_slurm",
    ),
    "tests_pytorch/trainer/connectors/test_data_connector.py": (
        "test_dataloader_persistent_workers_performance_warning",
        "test_dataloader_reinit_for_subclass",
    ),
    "tests_pytorch/trainer/logging_/test_train_loop_logging.py": ("test_logging_sync_dist_true",),
    "tests_pytorch/trainer/optimization/test_manual_optimization.py": ("test_manual_optimization_and_return_tensor",),
    "tests_pytorch/trainer/optimization/test_optimizers.py": ("test_optimizer_state_on_device",),
    "tests_pytorch/trainer/properties/test_estimated_stepping_batches.py": ("test_num_stepping_batches_gpu",),
    "tests_pytorch/trainer/test_trainer.py": (
        "test_error_handling_all_stages",
        "test_fit_test_synchronization",
        "test_model_in_correct_mode_during_stages",
        "test_multiple_trainer_constant_memory_allocated",
        "test_trainer_predict_standalone",
    ),
    "tests_pytorch/utilities/test_all_gather_grad.py": ("test_all_gather_collection", "test_all_gather_sync_grads"),
    "tests_pytorch/utilities/test_combined_loader.py": ("test_combined_data_loader_validation_test",),
}

STANDALONE = (
    "tests_pytorch/overrides/test_distributed.py::test_params_synced_during_nonfit",
    "tests_pytorch/strategies/launchers/test_multiprocessing.py::test_multiprocessing_launcher_restore_globals[fork]",
    "tests_pytorch/strategies/launchers/test_multiprocessing.py::test_multiprocessing_launcher_start_method[fork]",
    "tests_pytorch/strategies/test_ddp_integration.py::test_find_unused_parameters_ddp_exception",
    "tests_pytorch/strategies/test_ddp_integration.py::test_find_unused_parameters_ddp_spawn_raises",
    "tests_pytorch/trainer/connectors/test_accelerator_connector.py::test_strategy_choice_ddp_on_cpu",
    "tests_pytorch/trainer/test_dataloaders.py::test_distributed_sampler_without_global_seed",
    "tests_pytorch/tuner/test_lr_finder.py::test_lr_finder_with_ddp",
)

# --quick: a smoke run of the runner itself (a few minutes), never the committed record.
QUICK_FILES = ("tests_pytorch/strategies/test_registry.py", "tests_pytorch/checkpointing/test_torch_saving.py")
QUICK_STANDALONE = (
    "tests_pytorch/strategies/test_ddp_integration.py::test_find_unused_parameters_ddp_exception",
    "tests_pytorch/trainer/connectors/test_accelerator_connector.py::test_strategy_choice_ddp_on_cpu",
)

_UNUSED_PARAMETERS = (
    "expects torch DDP's error for a parameter without a gradient (find_unused_parameters=False); custom_ddp "
    "checks nothing there: its gradient sync sends zeros flagged unused for such a parameter and the fit "
    "trains (docs/strategy.md, gradient sync)"
)
_READS_THE_ENTRY = (
    "reads the registry entry itself (DDPStrategy with find_unused_parameters): the entry the swap replaces"
)
_READS_DDP_KWARGS = (
    "reads strategy._ddp_kwargs, the arguments Lightning passes to torch's DistributedDataParallel: custom_ddp "
    "does not wrap the module in it and passes it nothing (it accepts find_unused_parameters, with no effect)"
)
_FIND_UNUSED_NAMES = tuple(
    f"{base}_find_unused_parameters_{value}"
    for base in ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook")
    for value in ("false", "true")
)
_REGISTRY_TEST = "tests_pytorch/strategies/test_registry.py::test_ddp_find_unused_parameters_strategy_registry"
_KWARGS_TEST = "tests_pytorch/strategies/test_ddp.py::test_ddp_kwargs_from_registry"
# pytest's ids end with the index of the expected value in each test's parameter list (Lightning 2.6.5).
_KWARGS_INDEX = dict(zip(_FIND_UNUSED_NAMES, (10, 11, 3, 4, 5, 6, 7, 8), strict=True))
EXPECTED_DIFFERENCES = {
    "tests_pytorch/strategies/test_ddp_integration.py::test_find_unused_parameters_ddp_spawn_raises": (
        _UNUSED_PARAMETERS
    ),
    "tests_pytorch/strategies/test_ddp_integration.py::test_find_unused_parameters_ddp_exception": _UNUSED_PARAMETERS,
    **{
        f"{_REGISTRY_TEST}[{name}-DDPStrategy-expected_init_params{index}]": _READS_THE_ENTRY
        for index, name in enumerate(_FIND_UNUSED_NAMES)
    },
    **{
        f"{_KWARGS_TEST}[{name}-expected_ddp_kwargs{index}]": _READS_DDP_KWARGS for name, index in _KWARGS_INDEX.items()
    },
}


def k_expression(test_file: str) -> str:
    """The ``-k`` expression of ``test_file``: :data:`K_EXPRESSION` or a name of :data:`NAMED_IN_SOURCE`."""
    return " or ".join((K_EXPRESSION, *NAMED_IN_SOURCE.get(test_file, ())))


def expected_difference(test_id: str) -> str | None:
    """Why ``test_id`` is expected to pass only under ddp, or ``None``."""
    return EXPECTED_DIFFERENCES.get(test_id)
