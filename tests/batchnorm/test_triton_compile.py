"""SyncBatchNorm's Triton kernels (:mod:`parallel.batchnorm.triton_kernels`) compile for GPUs, without one.

Triton's own compiler and ptxas (shipped with Triton) build every kernel for sm_75 (T4), sm_80 (A100) and sm_90
(H100, H200) from a process where the kernels are not interpreted: what ``tests/batchnorm/test_syncbn_fused.py``'s
interpreter cannot tell, that they are valid compiled Triton. Runs on the oldest supported torch too (``.ci/run``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Compiles every kernel for a GPU architecture with Triton's own compiler and ptxas, no GPU needed: bf16 tensors,
# fp32 statistics, every flag on (what the interpreter cannot tell: that the kernels are valid compiled Triton).
_COMPILE_FOR = textwrap.dedent("""
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from parallel.batchnorm import triton_kernels

    CONSTANTS = {"BLOCK": 1024, "BLOCK_C": 128}
    def kind(name):
        if name in ("x_ptr", "y_ptr", "g_ptr", "dx_ptr"):
            return "*bf16"
        return "*fp32" if name.endswith("_ptr") else "fp32" if name in ("momentum", "eps") else "i32"
    for arch in map(int, sys.argv[1:]):
        for name in triton_kernels.__all__:
            fn = getattr(triton_kernels, name)
            signature = {p.name: "constexpr" if p.is_constexpr else kind(p.name) for p in fn.params}
            constexprs = {(i,): CONSTANTS.get(p.name, True) for i, p in enumerate(fn.params) if p.is_constexpr}
            kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32))
            print(arch, name, len(kernel.asm["cubin"]))
""")


@pytest.mark.long
def test_every_kernel_compiles_for_t4_a100_and_h100_gpus(tmp_path):
    """sm_75 (T4), sm_80 (A100), sm_90 (H100, H200): ~4 s, in a process where the kernels are not interpreted."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-c", _COMPILE_FOR, "75", "80", "90"]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = [line.split() for line in result.stdout.splitlines()]
    assert len(compiled) == 15 and all(int(size) > 0 for *_, size in compiled)
