"""SyncBatchNorm: the autograd Function (one collective forward, one backward), its passes over x-sized memory
and the ``BatchNorm*d`` drop-in module.

- ``syncbn_function``: the Function and the hand-derived backward (the math, in its docstring).
- ``syncbn_kernels``: the x-sized passes, eager (the reference) or compiled with ``torch.compile``.
- ``syncbn_fused`` + ``triton_kernels``: the CUDA path, the same math in five Triton kernels (imported lazily).
- ``syncbn``: ``SyncBatchNorm``, its ``convert`` / ``revert``, torch's native batch norm where nothing syncs;
  ``syncbn_convert``: how those two walk a model (a layer in several places replaced once).

May import: ``parallel.torch_compat``. Its statistics' other transport (``parallel.host.host_exchange``) is handed
in, never imported. Nothing is imported here.
"""
