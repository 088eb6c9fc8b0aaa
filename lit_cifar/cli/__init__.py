"""What ``train.py``'s command line adds around LightningCLI: nothing a LightningModule or a strategy needs.

Modules: ``option_errors`` (a bad option in one line, not a traceback), ``console`` (Lightning's tips
and two known warnings dropped at their source), ``run_dir`` (the run folder under
``--trainer.default_root_dir``; ``--ckpt_path last`` across versions), ``fit_summary`` (rank 0's
summary at the end of a fit). Nothing is imported here.
"""
