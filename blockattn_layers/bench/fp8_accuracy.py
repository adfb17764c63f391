"""``python -m blockattn_layers.bench.fp8_accuracy``: fp8 inference's error on the demo model's activations.

Trains the demo's click model (``make demo``'s settings for the device, ``--steps`` of them),
records the input of each of its attention sub-layers (QKV projection, attention, output
projection) on held-out users, and for each sub-layer compares against the float64 sub-layer on
the same (bfloat16-rounded) input:

- ``bf16``: the sub-layer in bfloat16;
- ``fp8``: the bfloat16 sub-layer converted by ``to_fp8_inference`` (calibrated on training
  users' activations), e4m3 q, k, v;
- where the error comes from, float64 attention on q, k, v of which only some are rounded to
  e4m3 (per-head factors): ``v only``, ``q, k only``.

Prints one line per sub-layer and method (relative Frobenius error of the sub-layer's output);
``--out FILE`` also writes them as CSV. Runs on the CPU (the reference attention on descaled
copies) or a GPU (the fp8 kernels).
"""
from __future__ import annotations

import argparse
import copy
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

import blockattn_layers as bl
from blockattn_layers import fp8

from ..cli.demo import build_trainer
from ..cli.demo_config import load_demo_config
from ..cli.demo_data import SyntheticClicks
from .fp8 import write_csv


def _rel(got: Tensor, want: Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _record_inputs(model: nn.Module, as_input, batches) -> Dict[nn.Module, list]:
    """Each attention sub-layer's ``(values, offsets)`` on ``batches`` (forward pre-hooks)."""
    layers = [m for m in model.modules() if isinstance(m, bl.BlockSelfAttention)]
    seen: Dict[nn.Module, list] = {layer: [] for layer in layers}
    hooks = [layer.register_forward_pre_hook(lambda m, args: seen[m].append((args[0].detach(), args[1])))
             for layer in layers]
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                model(as_input(batch))
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _rounded_qkv_error(layer64: nn.Module, values: Tensor, offsets: Tensor, want: Tensor, which: str) -> float:
    """Error of the float64 sub-layer when only ``which`` of q, k, v are rounded to e4m3."""
    q, k, v = layer64._qkv(values)

    def rounded(x: Tensor, name: str) -> Tensor:
        if name not in which:
            return x
        x8, descale = bl.quantize_fp8(x, "head")
        return fp8.dequantize(x8, descale, offsets, 1, torch.float64)

    out = bl.block_attention(rounded(q, "q"), rounded(k, "k"), rounded(v, "v"), offsets, layer64.block_size,
                             backend="reference", causal=layer64.causal, **layer64._attention_kwargs(None))
    return _rel(layer64.out_proj(out.flatten(1)), want)


def sublayer_rows(device: torch.device, steps: Optional[int]) -> List[dict]:
    config = load_demo_config(cuda=device.type == "cuda", steps=steps)
    trainer = build_trainer(config, device, use_torchrec=False)
    data = SyntheticClicks(config.data, device)
    gen = torch.Generator(device).manual_seed(config.data.seed + 1)
    trainer.fit(lambda: data.batch(config.data.batch_size, gen), config.train.steps, desc="train (fp8 accuracy)")
    calibration = _record_inputs(trainer.model, trainer.as_input, [data.batch(config.data.batch_size, gen)])
    held_out = _record_inputs(trainer.model, trainer.as_input, data.eval_batches(seed=config.data.seed + 2)[:1])
    rows = []
    for i, (layer, seen) in enumerate(held_out.items()):
        values, offsets = seen[0]
        values = values.to(torch.bfloat16)
        bf16 = copy.deepcopy(layer).to(torch.bfloat16).eval()
        layer64 = copy.deepcopy(layer).double().eval()
        sample = [(x.to(torch.bfloat16), o) for x, o in calibration[layer]]
        served = bl.to_fp8_inference(copy.deepcopy(bf16), sample)
        with torch.no_grad():
            want = layer64(values.double(), offsets)
            errors = {"bf16": _rel(bf16(values, offsets), want), "fp8": _rel(served(values, offsets), want),
                      "v only": _rounded_qkv_error(layer64, values.double(), offsets, want, "v"),
                      "q, k only": _rounded_qkv_error(layer64, values.double(), offsets, want, "qk")}
        shape = (f"layer {i}: d_model {layer.embed_dim}, {layer.num_heads} heads, D {layer.head_dim}, "
                 f"T {values.shape[0]}")
        for method, err in errors.items():
            rows.append(dict(sublayer=shape, method=method, err=err, ratio_to_bf16=err / errors["bf16"]))
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blockattn_layers.bench.fp8_accuracy",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the demo's)")
    parser.add_argument("--out", default=None, help="CSV file for the rows")
    args = parser.parse_args(argv)
    rows = sublayer_rows(torch.device(args.device), args.steps)
    for r in rows:
        print(f"{r['sublayer']:48} {r['method']:10} err {r['err']:.2e}  ({r['ratio_to_bf16']:.1f}x bf16's)")
    if args.out:
        write_csv(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
