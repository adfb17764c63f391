"""``python -m blockattn_layers demo``: train a click model on synthetic jagged user histories.

Features (item ids, category ids) -> ``KeyedJaggedTensor`` -> ``EmbeddingCollection`` ->
``JaggedTransformerEncoder`` (rotary, block attention) -> mean pooling -> MLP -> click logit,
BCE loss. Prints the loss falling, held-out AUC, tokens per second, the attention backend and,
when that is not the reference, the same training step timed on the reference for a speedup.
With ``--distributed`` (under torchrun) the same model trains under torchrec's
DistributedModelParallel instead: see :mod:`.dmp_demo`.
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Optional

import torch

from ..dispatch import AttentionRequest, select_backend
from .backend_choice import auto_choice, describe_request
from .demo_config import SHARDINGS, DemoConfig, load_demo_config
from .demo_data import FEATURES, SyntheticClicks
from .demo_model import build_click_model, torchrec_problem
from .demo_train import FitResult, Trainer, make_autocast, time_steps

_LOSS_WINDOW = 10
DESCRIPTION = ("Train a click model on synthetic jagged user histories (item and category ids -> "
               "EmbeddingCollection -> JaggedTransformerEncoder -> click logit) and report the loss, held-out "
               "AUC and tokens per second. With --distributed (started by torchrun) it trains under torchrec's "
               "DistributedModelParallel.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's flags (each overrides the config file)."""
    p.add_argument("--config", default=None, help="YAML settings (default: the packaged configs/demo.yaml)")
    p.add_argument("--backend", default=None, help="attention backend: auto, reference, triton")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--steps", type=int, default=None, help="training steps")
    p.add_argument("--batch-size", type=int, default=None, help="users per batch")
    p.add_argument("--seed", type=int, default=None, help="seed of the data and the model")
    p.add_argument("--threads", type=int, default=None, help="torch threads on CPU (0: torch's default)")
    p.add_argument("--no-torchrec", action="store_true", help="use nn.Embedding even when torchrec is installed")
    dmp = p.add_argument_group(
        "distributed (start with torchrun --nproc_per_node=N -m blockattn_layers demo --distributed)")
    dmp.add_argument("--distributed", action="store_true",
                     help="train under torchrec DistributedModelParallel with TrainPipelineSparseDist, one rank per "
                          "process (NCCL on GPUs when available, else gloo on the CPU)")
    dmp.add_argument("--sharding", default="planner", choices=SHARDINGS,
                     help="how the embedding tables are sharded (fused kernel); planner: torchrec's planner decides")
    dmp.add_argument("--checkpoint", default=None, metavar="DIR", help="save the sharded state to DIR at the end")
    dmp.add_argument("--resume", default=None, metavar="DIR", help="start from the state saved in DIR")


def _device(flag: Optional[str], config_path: Optional[str]) -> torch.device:
    name = flag or load_demo_config(config_path).train.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available (torch {torch.__version__})")
    return device


def _request(config: DemoConfig, device: torch.device) -> AttentionRequest:
    layer = config.encoder.layer
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return AttentionRequest(
        device_type=device.type, capability=capability,
        dtype=torch.bfloat16 if config.train.amp == "bf16" else torch.float32,
        head_dim=layer.d_model // layer.nhead, num_heads=layer.nhead,
        num_kv_heads=layer.num_kv_heads or layer.nhead, block_size=layer.block_size,
        causal=layer.causal, rotary=layer.rope_theta is not None,
    )


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"mean of steps {first}-{last}"


def _header(config: DemoConfig, device: torch.device, request: AttentionRequest, backend: str,
            no_torchrec: Optional[str]) -> None:
    data_cfg, train_cfg, layer = config.data, config.train, config.encoder.layer
    threads = f", {torch.get_num_threads()} thread(s)" if device.type == "cpu" else ""
    print("blockattn_layers demo: a click model on synthetic user histories")
    print(f"  device {device}{threads} | torch {torch.__version__} | {train_cfg.steps} steps of "
          f"{data_cfg.batch_size} users | histories of 1-{data_cfg.max_history} events, "
          f"{data_cfg.empty_fraction:.0%} empty")
    if no_torchrec is None:
        print(f"  features {', '.join(FEATURES)}: KeyedJaggedTensor -> torchrec EmbeddingCollection")
    else:
        print(f"  note: {no_torchrec}; each feature is embedded by a plain nn.Embedding over (values, offsets)")
    print(f"  encoder: {config.encoder.num_layers} x JaggedTransformerEncoderLayer(d_model={layer.d_model}, "
          f"nhead={layer.nhead}, block_size={layer.block_size}, rope_theta={layer.rope_theta})"
          " -> mean pooling -> MLP -> click logit")
    print(f"  attention: {describe_request(request)} | backend={train_cfg.backend!r} -> {backend}")
    if train_cfg.backend == "auto":
        for name, why in auto_choice(request)[1].items():
            if why:
                print(f"    {name} not used: {'; '.join(why)}")


def build_trainer(config: DemoConfig, device: torch.device, use_torchrec: bool) -> Trainer:
    """The demo's click model (seeded by the data seed), its Adam optimiser and autocast."""
    layer = config.encoder.layer
    torch.manual_seed(config.data.seed)
    model = build_click_model(
        FEATURES, (config.data.num_items, config.data.num_categories), config.encoder.build(), layer.d_model,
        config.train.mlp_hidden, use_torchrec=use_torchrec,
    ).to(device)
    as_input = (lambda b: b.to_kjt()) if use_torchrec else (lambda b: (b.ids, b.lengths))
    optimizer = torch.optim.Adam(model.parameters(), lr=config.train.lr)
    return Trainer(model, optimizer, as_input, make_autocast(device, config.train.amp))


def _report(fit: FitResult, held_out: dict, eval_users: int) -> None:
    steps, window = len(fit.losses), max(1, min(_LOSS_WINDOW, len(fit.losses) // 2))
    first, last = _mean(fit.losses[:window]), _mean(fit.losses[-window:])
    trend = "falling" if last < first else "not falling"
    print(f"loss: {first:.4f} ({_steps(1, window)}) -> {last:.4f} ({_steps(steps - window + 1, steps)}): {trend}")
    print(f"held-out AUC: {held_out['auc']:.3f} over {eval_users} users, loss {held_out['loss']:.4f} "
          f"(the true click probabilities reach AUC {held_out['best_auc']:.3f}; chance is 0.5)")
    step_ms = 1e3 * fit.seconds / max(1, steps - 1)
    print(f"throughput: {fit.tokens_per_second:,.0f} tokens/s ({step_ms:.1f} ms per training step, "
          f"{len(FEATURES)} features)")


def run(args: argparse.Namespace) -> int:
    """Train, evaluate and report; returns the exit status."""
    if args.distributed:
        problem = torchrec_problem()
        if problem is not None:
            raise SystemExit(f"demo --distributed needs torchrec: {problem}")
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise SystemExit("demo --distributed runs one process per rank: start it with torchrun, e.g. "
                             "torchrun --nproc_per_node=2 -m blockattn_layers demo --distributed")
        from .dmp_demo import run as run_distributed

        return run_distributed(args)
    if args.sharding != "planner" or args.checkpoint or args.resume:
        raise SystemExit("demo: --sharding, --checkpoint and --resume need --distributed")
    start = time.perf_counter()
    try:
        device = _device(args.device, args.config)
        config = load_demo_config(
            args.config, cuda=device.type == "cuda", steps=args.steps, backend=args.backend,
            batch_size=args.batch_size, seed=args.seed, cpu_threads=args.threads,
        )
        request = _request(config, device)
        backend = select_backend(config.train.backend, request).name
    except (OSError, RuntimeError, TypeError, ValueError) as err:
        raise SystemExit(f"demo: {err}")
    data_cfg, train_cfg = config.data, config.train
    problem = torchrec_problem()
    no_torchrec = "--no-torchrec given" if args.no_torchrec else problem and f"torchrec unavailable ({problem})"
    use_torchrec = no_torchrec is None
    if use_torchrec:
        # torchrec calls torch.fx's is_fx_tracing, which logs a deprecation notice that is not about this demo.
        logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    if device.type == "cpu" and train_cfg.cpu_threads:
        torch.set_num_threads(train_cfg.cpu_threads)
    _header(config, device, request, backend, no_torchrec)

    trainer = build_trainer(config, device, use_torchrec)
    data = SyntheticClicks(data_cfg, device)
    gen = torch.Generator(device).manual_seed(data_cfg.seed + 1)
    fit = trainer.fit(lambda: data.batch(data_cfg.batch_size, gen), train_cfg.steps, desc=f"train ({backend})")
    _report(fit, trainer.evaluate(data.eval_batches(seed=data_cfg.seed + 2)), data_cfg.eval_users)
    print(f"backend used: {backend}")
    if backend == "reference":
        print("speedup vs reference: n/a, the demo ran on the reference backend "
              "(on a CUDA GPU backend='auto' picks the Triton kernels and this line compares them)")
    elif train_cfg.compare_steps:
        batch = data.batch(data_cfg.batch_size, gen)
        ours = time_steps(trainer, batch, train_cfg.compare_steps, backend)
        ref = time_steps(trainer, batch, train_cfg.compare_steps, "reference")
        print(f"speedup vs reference: {ref / ours:.3g}x per training step ({backend} {1e3 * ours:.1f} ms, "
              f"reference {1e3 * ref:.1f} ms, median of {train_cfg.compare_steps} steps on one batch)")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0
