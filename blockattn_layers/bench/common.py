"""Data shared by the benchmark's parts: a case, its inputs, and a prepared method.

A :class:`Case` is one benchmark problem (lengths, heads, head dim, block size, rotary or
a layer config). :func:`make_inputs` draws seeded random inputs for it. Every method
(ours or a baseline) is a :class:`Method` whose ``setup`` turns a case and its inputs into
a :class:`Prepared`: a forward callable plus what the runner needs to check and time it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, Sequence, Tuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class LayerConfig:
    """An encoder layer: ``d_model``, ``nhead``, ``dim_feedforward``."""

    d_model: int
    nhead: int
    dim_feedforward: int


@dataclass(frozen=True, eq=False)
class Case:
    """One problem: ``lengths`` (host int64 ``[B]``), heads, head dim, block (None = full)."""

    name: str
    shape: str
    lengths: Tensor
    num_heads: int
    head_dim: int
    block_size: Optional[int]
    rope_theta: Optional[float] = None
    layer: Optional[LayerConfig] = None
    graphed: bool = False
    # Timed in this many rounds, the methods interleaved, each mode's median reported (host-bound cases).
    rounds: int = 1
    # k / v heads (None = num_heads; fewer = GQA / MQA), causal masking inside each unit, and the
    # rotary form: rotate the first ``rotary_dim`` channels (None = all), pairs interleaved or split.
    num_kv_heads: Optional[int] = None
    causal: bool = False
    rotary_dim: Optional[int] = None
    rotary_interleaved: bool = False
    # A grid point's coordinates (bench/grid.py), e.g. (("block", 64), ("dim", 128), ...); None elsewhere.
    coords: Optional[Tuple[Tuple[str, object], ...]] = None

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def rotary_form(self) -> str:
        """``none``, ``split``, ``interleaved`` or ``partial`` (fewer channels than D rotated)."""
        if self.rope_theta is None:
            return "none"
        if self.rotary_dim is not None and self.rotary_dim < self.head_dim:
            return "partial" + ("-interleaved" if self.rotary_interleaved else "")
        return "interleaved" if self.rotary_interleaved else "split"

    @property
    def compile_key(self) -> Optional[tuple]:
        """Cases with the same key may share torch.compile'd graphs (grid points only: other cases
        reset the compiled graphs before each case)."""
        if self.coords is None:
            return None
        return (self.total, self.num_heads, self.kv_heads, self.head_dim, self.rotary_form, self.rotary_dim)

    @property
    def batch(self) -> int:
        return self.lengths.numel()

    @property
    def total(self) -> int:
        return int(self.lengths.sum())

    @property
    def max_seqlen(self) -> int:
        return int(self.lengths.max()) if self.batch else 0

    @property
    def offsets(self) -> Tensor:
        """Host int64 ``[B+1]``."""
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(self.lengths, 0)])

    @property
    def aligned(self) -> bool:
        """Every sequence is a whole number of blocks (so blocks form a dense view)."""
        return self.block_size is not None and bool((self.lengths % self.block_size == 0).all())

    def unit_bounds(self) -> Tensor:
        """Host int64 boundaries of the attention units (blocks, or sequences if full)."""
        if self.block_size is None:
            lengths, offsets = self.lengths, self.offsets
            keep = torch.nonzero(lengths > 0).flatten()
            return torch.cat([offsets[:-1][keep], offsets[-1:]])
        bs = self.block_size
        n_blocks = (self.lengths + bs - 1) // bs
        seq = torch.repeat_interleave(torch.arange(self.batch), n_blocks)
        first = torch.cumsum(n_blocks, 0) - n_blocks
        starts = self.offsets[:-1][seq] + (torch.arange(int(n_blocks.sum())) - first[seq]) * bs
        return torch.cat([starts, self.offsets[-1:]])

    def describe(self) -> str:
        block = "full" if self.block_size is None else f"block {self.block_size}"
        rope = ""
        if self.rope_theta is not None:
            rope = f", rope {self.rope_theta:g}"
            if self.rotary_form != "split":
                rot = self.head_dim if self.rotary_dim is None else self.rotary_dim
                rope += f" {self.rotary_form} (rotary_dim {rot})"
        if self.causal:
            rope += ", causal"
        if self.layer is not None:
            cfg = self.layer
            heads = f"d_model {cfg.d_model}, nhead {cfg.nhead}, ffn {cfg.dim_feedforward}"
        else:
            kv = f"/{self.kv_heads} kv" if self.kv_heads != self.num_heads else ""
            heads = f"H {self.num_heads}{kv}, D {self.head_dim}"
        graph = ", timed as CUDA-graph replays" if self.graphed else ""
        if self.rounds > 1:
            graph += f", median of {self.rounds} rounds with the methods interleaved"
        return f"B {self.batch}, T {self.total:,}, max len {self.max_seqlen}, {heads}, {block}{rope}{graph}"


@dataclass(eq=False)
class Inputs:
    """One input set of an attention case on the benchmark device.

    ``q, k, v`` are leaves that require grad; ``bounds`` (int32) are the attention units'
    boundaries (block starts, or sequence starts for full attention) and ``max_unit`` the
    longest unit; ``positions`` (int32) each token's index inside its sequence. ``k, v`` have
    ``case.kv_heads`` heads.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    grad_out: Tensor
    offsets: Tensor
    cpu_offsets: Tensor
    bounds: Tensor
    max_unit: int
    positions: Tensor


def make_inputs(case: Case, device: torch.device, dtype: torch.dtype, seed: int) -> Inputs:
    """Seeded random ``q, k, v`` (leaves) and output gradient for ``case``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    def rand(requires_grad: bool, heads: int) -> Tensor:
        shape = (case.total, heads, case.head_dim)
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        return x.requires_grad_(requires_grad)

    q, k, v = rand(True, case.num_heads), rand(True, case.kv_heads), rand(True, case.kv_heads)
    host = case.offsets
    bounds = case.unit_bounds()
    max_unit = int((bounds[1:] - bounds[:-1]).max()) if bounds.numel() > 1 else 0
    seq = torch.repeat_interleave(torch.arange(case.batch), case.lengths)
    positions = torch.arange(case.total) - host[:-1][seq]
    return Inputs(
        q=q, k=k, v=v, grad_out=rand(False, case.num_heads), offsets=host.to(device, torch.int32), cpu_offsets=host,
        bounds=bounds.to(device, torch.int32), max_unit=max_unit, positions=positions.to(device, torch.int32),
    )


@dataclass(frozen=True)
class RunConfig:
    """Settings every method may read."""

    device: torch.device
    dtype: torch.dtype
    with_reference: bool = False
    host_offsets: bool = False


@dataclass(eq=False)
class Prepared:
    """A method ready to run on one input set.

    ``forward()`` returns the output in the method's own layout; ``grad_out`` has that
    layout, and gradients are taken w.r.t. ``leaves``. ``to_packed``/``grads_to_packed``
    bring the output and the first gradients to the packed layout for the check.
    ``checked=False`` marks a speed bound that computes a different function (for
    example padded attention without a mask). ``oracle``, when set, returns the float32
    reference ``(out, grads)`` for this method (layers); otherwise the case's attention
    oracle is used.
    """

    forward: Callable[[], Tensor]
    leaves: Tuple[Tensor, ...]
    grad_out: Tensor
    to_packed: Callable[[Tensor], Tensor] = field(default=lambda out: out)
    grads_to_packed: Callable[[Sequence[Tensor]], Sequence[Tensor]] = field(default=tuple)
    checked: bool = True
    oracle: Optional[Callable[[], Tuple[Tensor, Sequence[Tensor]]]] = None
    note: str = ""


def _no_skip(case: Case, cfg: RunConfig) -> Optional[str]:
    return None


@dataclass(frozen=True)
class Method:
    """A way to compute a case: ``kind`` is ``"ours"`` or ``"baseline"``.

    ``applies(case)`` False leaves the method out of that case's table; ``skip(case, cfg)``
    returns a reason shown as a ``skipped: ...`` row; ``setup`` may raise, which the runner
    reports as ``failed: ...``. The whole row (check and timings) runs inside ``context()``.
    ``opt_in``: run only when ``--backends`` names it (a method known to crash the process's CUDA
    context somewhere, which would end the run for every method after it, or a measurement outside
    the package's API); its reason says why.
    """

    name: str
    kind: str
    setup: Callable[[Case, Inputs, RunConfig], Prepared]
    applies: Callable[[Case], bool]
    skip: Callable[[Case, RunConfig], Optional[str]] = _no_skip
    gpu_only: bool = True
    description: str = ""
    context: Callable[[], ContextManager] = contextlib.nullcontext
    opt_in: Optional[str] = None


@contextlib.contextmanager
def module_attrs(module, **values):
    """``module.NAME = value`` for each keyword (a kernel's constants and head-dim sets) for a row's
    calls, the old values back afterwards."""
    before = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)
