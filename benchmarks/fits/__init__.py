"""Whole Lightning fits, ``custom_ddp`` against ``ddp``.

- ``compare``: ``python -m benchmarks.fits.compare``: fresh ``python train.py fit`` processes per variant: step
  time, collective counts and accuracy; the side-by-side report.
- ``compare_report``: that record's analysis, headline and report.
- ``variants``: what is compared: each variant's strategy flags, and the per-net fit settings.
- ``compare_runs``: how those runs are driven and read (flags, monitor, logs), shared with ``paired_fits``.
- ``paired_fits``: ``python -m benchmarks.fits.paired_fits``: the step-time target with the host's drift paired
  out: fits back to back in one pair of ranks.

Nothing is imported here.
"""
