"""Settings of the demo: ``configs/demo.yaml`` (installed as ``blockattn_layers.presets/demo.yaml``).

The file has three sections, ``data``, ``encoder`` (an :class:`~blockattn_layers.EncoderConfig`
mapping) and ``train``, plus a ``cuda`` section of the same shape whose values replace the
others when the demo runs on a GPU. Command-line flags override both.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import yaml

from ..config import PRESETS_PACKAGE, EncoderConfig

_SECTIONS = ("data", "encoder", "train")
SHARDINGS = ("table_wise", "row_wise", "column_wise", "planner")
"""``demo --distributed --sharding``: every table table-wise, row-wise or column-wise (fused compute
kernel), or the plan torchrec's planner makes."""


@dataclass(frozen=True)
class DataConfig:
    """The synthetic click data (see :mod:`blockattn_layers.cli.demo_data`)."""

    num_items: int = 1000
    num_categories: int = 40
    hot_categories: int = 8
    max_history: int = 160
    empty_fraction: float = 0.1
    batch_size: int = 128
    eval_users: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.hot_categories < self.num_categories <= self.num_items:
            raise ValueError("need 0 < hot_categories < num_categories <= num_items")
        if min(self.max_history, self.batch_size, self.eval_users) < 1:
            raise ValueError("max_history, batch_size and eval_users must be >= 1")
        if not 0.0 <= self.empty_fraction < 1.0:
            raise ValueError(f"empty_fraction must be in [0, 1), got {self.empty_fraction}")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, device and timing settings.

    ``lr`` is Adam's learning rate (every parameter in the single-process demo, the dense ones
    under DMP); ``sparse_lr`` is the Adagrad learning rate of the embedding tables under DMP
    (``demo --distributed``), where their optimizer is fused into the backward.
    """

    steps: int = 150
    lr: float = 3e-3
    sparse_lr: float = 0.1
    mlp_hidden: int = 64
    backend: str = "auto"
    device: str = "auto"
    amp: str = "none"
    cpu_threads: int = 1
    compare_steps: int = 5

    def __post_init__(self) -> None:
        if self.steps < 1 or self.compare_steps < 0 or self.cpu_threads < 0:
            raise ValueError("steps must be >= 1, compare_steps and cpu_threads >= 0")
        if not (self.lr > 0 and self.sparse_lr > 0):
            raise ValueError(f"lr and sparse_lr must be > 0, got {self.lr} and {self.sparse_lr}")
        if self.amp not in ("none", "bf16"):
            raise ValueError(f"amp must be 'none' or 'bf16', got {self.amp!r}")


@dataclass(frozen=True)
class DemoConfig:
    """Everything the demo needs; ``encoder.layer.d_model`` is also the embedding width."""

    data: DataConfig
    encoder: EncoderConfig
    train: TrainConfig


def _section(cls: type, data: Any, where: str) -> Any:
    """``cls(**data)``, naming the section and the known fields when ``data`` has unknown ones."""
    data = data or {}
    names = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(data, Mapping) or set(data) - names:
        unknown = sorted(set(data) - names) if isinstance(data, Mapping) else data
        raise ValueError(f"demo config: unknown {where} settings {unknown}; expected some of {sorted(names)}")
    return cls(**{k: float(v) if k in ("lr", "sparse_lr") else v for k, v in data.items()})


def _merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, Mapping) else value
    return out


def _read(path: Optional[str]) -> dict:
    if path is None:
        text = (importlib.resources.files(PRESETS_PACKAGE) / "demo.yaml").read_text(encoding="utf-8")
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{path or 'demo.yaml'}: expected a mapping with sections {_SECTIONS}")
    return data


def load_demo_config(path: Optional[str] = None, *, cuda: bool = False, **overrides: Any) -> DemoConfig:
    """The demo settings from ``path`` (default: the packaged ``demo.yaml``).

    ``cuda=True`` applies the file's ``cuda`` section. ``overrides`` are ``train`` or ``data``
    fields (``steps=20``, ``batch_size=64``, ``cpu_threads=2``); ``None`` values are ignored.
    ``backend`` also becomes the encoder layers' backend. Bad settings raise ``ValueError`` (a
    wrong value) or ``TypeError`` (a wrong type).
    """
    data = _read(path)
    unknown = sorted(set(data) - set(_SECTIONS) - {"cuda"})
    if unknown:
        raise ValueError(f"unknown demo config sections {unknown}; expected {list(_SECTIONS)} and 'cuda'")
    if cuda:
        data = _merge(data, data.get("cuda") or {})
    data_fields = {f.name for f in dataclasses.fields(DataConfig)}
    given = {k: v for k, v in overrides.items() if v is not None}
    data_given = {k: v for k, v in given.items() if k in data_fields}
    train_given = {k: v for k, v in given.items() if k not in data_fields}
    data_cfg = _section(DataConfig, {**(data.get("data") or {}), **data_given}, "data")
    train_cfg = _section(TrainConfig, {**(data.get("train") or {}), **train_given}, "train")
    encoder = EncoderConfig.from_dict(data.get("encoder") or {})
    layer = dataclasses.replace(encoder.layer, backend=train_cfg.backend)
    return DemoConfig(data_cfg, dataclasses.replace(encoder, layer=layer), train_cfg)
