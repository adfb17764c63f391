"""Every private torch and Triton API the package relies on, named in one place.

Tested with torch 2.11 (CUDA 13, on the H200) and torch 2.13 (CPU), Triton 3.6. Where one
disappears, the code that uses it takes the public path named beside it (slower host time, same
results), except where said.

torch (host time of small batches, and tracing):
- ``torch._C._FunctionBase.apply``: ``autograd.Function.apply`` without its Python wrapper
  (``ops.entry.raw_apply``; public fallback ``Function.apply``).
- ``torch._C._functorch.is_functorch_wrapped_tensor``, ``torch._C._are_functorch_transforms_active``:
  whether a call is under ``torch.func`` (``ops.entry.plain_eager``).
- ``torch._C._len_torch_dispatch_stack``: whether a dispatch mode (``FlopCounterMode``, fake modes)
  is active, so that the registered ops run (``ops.entry``).
- ``torch._C._is_any_autocast_enabled``: the cheap autocast test (``functional``), constant-folded
  by ``torch.compile``.
- ``torch._subclasses.fake_tensor.is_fake``: offsets without values in the FLOP formula
  (``ops.library``).

Triton (``kernels.common.launch``: direct launches; no public equivalent, the fallback is
``kernel[grid](...)``, set by ``Launcher.DIRECT = False``):
- ``CompiledKernel.run.launch``, ``.packed_metadata``, ``.function``, ``run.launch_cooperative_grid``,
  ``run.launch_pdl``, ``run.global_scratch_size``, ``run.profile_scratch_size``: the C launch
  function and its leading arguments;
- ``triton.runtime._allocation._allocator`` / ``_NULL_ALLOCATOR``: the scratch allocator of the
  kernels that make tensor maps in the kernel (experimental ``hopper_ws``);
- ``triton.experimental.gluon._runtime.GluonASTSource``: compiling Gluon kernels without a GPU
  (``kernels.compile_check``).
"""
from __future__ import annotations

import torch

FUNCTION_APPLY = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
functorch_transforms_active = torch._C._are_functorch_transforms_active
dispatch_stack_depth = torch._C._len_torch_dispatch_stack
any_autocast_enabled = torch._C._is_any_autocast_enabled


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (shapes only)."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(t)
