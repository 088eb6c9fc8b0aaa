"""What one feature costs or saves, measured on its own.

- ``desync_cost``: ``desync_check=True`` per optimizer step (torch's collective fingerprint check).
- ``generator_keeping``: keeping every rank's random generators for exact resume, per optimizer step.
- ``eval_memory``: per-rank memory while scatter evaluation validates a large set.
- ``data_pipeline``: the batched tensor augmentation against torchvision's per-sample PIL pipeline.

Each runs as ``python -m benchmarks.costs.<name>``. Nothing is imported here.
"""
