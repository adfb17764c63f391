"""Frozen settings for the jagged encoder, YAML presets, and building an encoder from them.

Presets live as YAML files in the package ``blockattn_layers.presets`` (the ``configs/``
directory): ``load_config("small")`` reads ``small.yaml``; a path to any YAML file works too.
A file holds ``num_layers``, ``final_norm`` and a ``layer`` mapping of
:class:`EncoderLayerConfig` fields.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import os
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Union

from torch import nn

from ._validation import check_bool, check_encoder_layer_args, check_int
from .modules import JaggedTransformerEncoder, JaggedTransformerEncoderLayer

PRESETS_PACKAGE = "blockattn_layers.presets"
_FLOAT_FIELDS = ("dropout", "rope_theta", "layer_norm_eps")


def _fields_from(cls: type, data: Mapping[str, Any], where: str) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {where} settings {unknown}; expected some of {sorted(names)}")
    # YAML 1.1 reads 1e-5 (no dot) as a string: accept it for float fields.
    return {k: _yaml_float(v) if k in _FLOAT_FIELDS else v for k, v in data.items()}


def _yaml_float(value: Any) -> Any:
    """``value`` as a float if it is a string that spells one; anything else is left to the checks."""
    if not isinstance(value, str):
        return value
    try:
        return float(value)
    except ValueError:
        return value


@dataclass(frozen=True)
class EncoderLayerConfig:
    """Arguments of :class:`~blockattn_layers.JaggedTransformerEncoderLayer`, validated on creation."""

    d_model: int
    nhead: int
    dim_feedforward: int = 2048
    dropout: float = 0.1
    activation: str = "relu"
    block_size: Optional[int] = 64
    norm_first: bool = False
    rope_theta: Optional[float] = None
    num_kv_heads: Optional[int] = None
    causal: bool = False
    layer_norm_eps: float = 1e-5
    bias: bool = True
    backend: str = "auto"
    rotary_dim: Optional[int] = None
    rotary_interleaved: bool = False

    def __post_init__(self) -> None:
        check_encoder_layer_args(
            self.d_model, self.nhead, self.dim_feedforward, self.dropout, self.activation,
            block_size=self.block_size, norm_first=self.norm_first, rope_theta=self.rope_theta,
            num_kv_heads=self.num_kv_heads, causal=self.causal, layer_norm_eps=self.layer_norm_eps,
            bias=self.bias, backend=self.backend, rotary_dim=self.rotary_dim,
            rotary_interleaved=self.rotary_interleaved, allow_callable=False,
        )

    def build(self) -> JaggedTransformerEncoderLayer:
        """A new layer with these settings (fresh weights)."""
        kwargs = dataclasses.asdict(self)
        d_model, nhead = kwargs.pop("d_model"), kwargs.pop("nhead")
        return JaggedTransformerEncoderLayer(d_model, nhead, **kwargs)


@dataclass(frozen=True)
class EncoderConfig:
    """A :class:`~blockattn_layers.JaggedTransformerEncoder`: ``num_layers`` copies of ``layer``,
    then a LayerNorm when ``final_norm`` (usual with ``norm_first`` layers)."""

    layer: EncoderLayerConfig
    num_layers: int = 1
    final_norm: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.layer, EncoderLayerConfig):
            raise TypeError(f"layer must be an EncoderLayerConfig, got {type(self.layer).__name__}")
        check_int("num_layers", self.num_layers)
        check_bool("final_norm", self.final_norm)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EncoderConfig":
        """From a mapping like the YAML presets: ``{"num_layers": 2, "layer": {"d_model": 64, ...}}``."""
        if not isinstance(data, Mapping) or not isinstance(data.get("layer"), Mapping):
            raise ValueError("an encoder config needs a 'layer' mapping of EncoderLayerConfig settings")
        top = _fields_from(cls, data, "encoder")
        top["layer"] = EncoderLayerConfig(**_fields_from(EncoderLayerConfig, data["layer"], "layer"))
        return cls(**top)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def build(self) -> JaggedTransformerEncoder:
        """A new encoder with these settings (fresh weights)."""
        layer = self.layer
        norm = nn.LayerNorm(layer.d_model, eps=layer.layer_norm_eps, bias=layer.bias) if self.final_norm else None
        return JaggedTransformerEncoder(layer.build(), self.num_layers, norm=norm)


def list_presets() -> List[str]:
    """Names of the encoder presets shipped in ``blockattn_layers.presets``.

    Other YAML files there (experiment settings such as ``demo.yaml``) are not encoder
    presets: only files with a top-level ``layer`` section are listed.
    """
    import yaml

    files = importlib.resources.files(PRESETS_PACKAGE).iterdir()
    return sorted(
        f.name[: -len(".yaml")] for f in files
        if f.name.endswith(".yaml") and "layer" in (yaml.safe_load(f.read_text(encoding="utf-8")) or {})
    )


def load_config(name_or_path: Union[str, os.PathLike]) -> EncoderConfig:
    """An :class:`EncoderConfig` from a preset name (``"small"``, ``"production"``) or a YAML file path.

    Example:
        >>> from blockattn_layers import load_config, build_encoder
        >>> config = load_config("small")
        >>> config.layer.d_model, config.num_layers
        (64, 2)
        >>> type(build_encoder(config)).__name__
        'JaggedTransformerEncoder'
    """
    import yaml

    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError("expected a preset name or a YAML path (str or os.PathLike), got "
                        f"{type(name_or_path).__name__}")
    text = os.fspath(name_or_path)
    if os.sep in text or text.endswith((".yaml", ".yml")):
        with open(text, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    else:
        resource = importlib.resources.files(PRESETS_PACKAGE) / f"{text}.yaml"
        if not resource.is_file() or text not in list_presets():
            raise ValueError(f"no preset named {text!r}; presets: {list_presets()} (or pass a .yaml path)")
        data = yaml.safe_load(resource.read_text(encoding="utf-8"))
    return EncoderConfig.from_dict(data)


def build_encoder(config: Union[EncoderConfig, Mapping[str, Any], str, os.PathLike]) -> JaggedTransformerEncoder:
    """A new :class:`~blockattn_layers.JaggedTransformerEncoder` from a config, its dict form
    (:meth:`EncoderConfig.from_dict`), a preset name or a YAML path."""
    if isinstance(config, Mapping):
        config = EncoderConfig.from_dict(config)
    elif not isinstance(config, EncoderConfig):
        config = load_config(config)
    return config.build()
