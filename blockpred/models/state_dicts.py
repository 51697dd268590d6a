"""Recognise a state dict's architecture and build the network it fits: :func:`build_from_state_dict`.

Two layouts are known, told apart by their keys:

* inferno's ``UNet`` (``_initial_conv.*``, ``_conv_bottom_op.*``) -> an
  :class:`InfernoUNet`; depth from the ``_conv_down_ops.<i>`` levels, in/out
  channels, initial features and gain from the convolution weights' shapes.
  The output activation cannot be read from tensors: it comes from ``hints``
  or ``model_kwargs``, and is asked for when the output has one;
* blockpred's :class:`UNet3d` (``bottom.*``, ``output.*``) -> a ``UNet3d``;
  depth, channels, widths, growth and pool factors from the shapes (a
  transposed convolution's kernel is its level's pool factor); padding and
  activations from the preset with the same shapes, else from ``model_kwargs``.

``model_kwargs`` override whatever was inferred.  The state dict is loaded
strictly (:func:`load_strict`); a mismatch raises :class:`ModelLoadError`.
:func:`find_state_dict` finds the state dict inside a loaded object.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from ..errors import ModelLoadError
from .inferno import InfernoUNet
from .presets import PRESETS
from .unet import UNet3d, _normalise_pool_factors

logger = logging.getLogger(__name__)

__all__ = ["build_from_state_dict", "find_state_dict", "load_strict", "strip_prefix"]

#: The keys a state dict may be wrapped under.
_WRAPPER_KEYS = ("state_dict", "model_state_dict", "model", "net", "network")


def find_state_dict(obj) -> dict[str, torch.Tensor] | None:
    """The state dict in ``obj``: itself, or under one of :data:`_WRAPPER_KEYS`."""
    if isinstance(obj, Mapping) and obj:
        if all(isinstance(k, str) for k in obj) and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return strip_prefix(dict(obj))
        for key in _WRAPPER_KEYS:
            if key in obj:
                found = find_state_dict(obj[key])
                if found is not None:
                    return found
    return None


def strip_prefix(state: dict) -> dict:
    """Drop the ``module.`` prefix ``DataParallel`` puts on every key."""
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module."):]: v for k, v in state.items()}
    return state


def build_from_state_dict(state: dict, kwargs: dict, path: Path, hints: dict) -> tuple[nn.Module, str] | None:
    """The network ``state`` (read from ``path``) fits, with ``state`` loaded, and its kind.

    The kind is ``"inferno-state-dict"`` or ``"state-dict"``; the configuration
    is what the shapes tell, then ``hints``, then ``kwargs``, each overriding the
    one before.  None when the keys match neither known layout.  The module is
    returned as built: the caller puts it in eval mode.
    """
    if "_initial_conv.conv.weight" in state and "_conv_bottom_op.0.conv.weight" in state:
        config = {**_infer_inferno_config(state, path), **hints, **kwargs}
        if "final_activation" not in config:
            if "_output.0.conv.weight" in state:
                raise ModelLoadError(
                    f"{str(path)!r} is an inferno UNet whose output has an activation (keys '_output.0.*') that "
                    f"its tensors cannot name; pass model_kwargs {{'final_activation': 'Sigmoid'}} (or the torch.nn "
                    f"activation it was trained with)"
                )
            config["final_activation"] = None
        module = _build(InfernoUNet, config, path)
        load_strict(module, state, repr(str(path)), f"an inferno UNet {_show(config)}")
        return module, "inferno-state-dict"
    if "output.weight" in state and "bottom.0.weight" in state:
        config = {**_infer_unet3d_config(state, path), **kwargs}
        missing = [k for k in ("padding", "activation", "final_activation") if k not in config]
        if missing:
            raise ModelLoadError(
                f"{str(path)!r} is a blockpred UNet3d state dict whose {', '.join(missing)} its tensors cannot "
                f"tell; pass them in model_kwargs, or load it as --model <preset> --weights {str(path)!r}"
            )
        module = _build(UNet3d, config, path)
        load_strict(module, state, repr(str(path)), f"a UNet3d {_show(config)}")
        return module, "state-dict"
    return None


def _show(config: dict) -> str:
    return "(" + ", ".join(f"{k}={v!r}" for k, v in config.items()) + ")"


def _build(cls, config: dict, path: Path) -> nn.Module:
    try:
        return cls(**config)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"cannot build {cls.__name__} for {str(path)!r} from {_show(config)}: {exc}") from exc


def _weight(state: dict, key: str, path: Path) -> torch.Tensor:
    tensor = state.get(key)
    if tensor is None:
        raise ModelLoadError(f"{str(path)!r} looks like a known state dict but lacks {key!r} (truncated or edited?)")
    if tensor.dim() != 5:
        raise ModelLoadError(
            f"{str(path)!r}: {key!r} must be a 3D convolution weight (5 dimensions), found shape "
            f"{tuple(tensor.shape)}; blockpred runs 3D networks only"
        )
    return tensor


def _levels(state: dict, prefix: str) -> int:
    """How many consecutive indices ``prefix<i>.`` the keys use."""
    indices = {int(m.group(1)) for k in state if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    count = 0
    while count in indices:
        count += 1
    return count


def _infer_inferno_config(state: dict, path: Path) -> dict:
    first = _weight(state, "_initial_conv.conv.weight", path)
    initial_features, in_channels = int(first.shape[0]), int(first.shape[1])
    depth = _levels(state, "_conv_down_ops.")
    if depth < 1:
        raise ModelLoadError(f"{str(path)!r} looks like an inferno UNet but has no '_conv_down_ops.0.*' weights")
    second = int(_weight(state, "_conv_down_ops.0.conv.weight", path).shape[0])
    if second % initial_features:
        raise ModelLoadError(
            f"{str(path)!r}: inferno UNet levels must grow by an integer gain, found {initial_features} -> {second} "
            f"feature maps"
        )
    key = "_output.0.conv.weight" if "_output.0.conv.weight" in state else "_output.conv.weight"
    out_channels = int(_weight(state, key, path).shape[0])
    return dict(in_channels=in_channels, out_channels=out_channels, dim=3, depth=depth,
                initial_features=initial_features, gain=second // initial_features)


def _infer_unet3d_config(state: dict, path: Path) -> dict:
    depth = _levels(state, "encoders.")
    first = _weight(state, "encoders.0.0.weight" if depth else "bottom.0.weight", path)
    initial_features, in_channels = int(first.shape[0]), int(first.shape[1])
    next_features = int(_weight(state, "encoders.1.0.weight" if depth > 1 else "bottom.0.weight", path).shape[0])
    growth = next_features // initial_features if depth else 2
    # upsamplers run deepest first; a transposed conv's kernel is its level's pool factor.
    pool_factors = [None] * depth
    for j in range(depth):
        kernel = _weight(state, f"upsamplers.{j}.weight", path).shape[2:]
        pool_factors[depth - 1 - j] = tuple(int(v) for v in kernel)
    config = dict(in_channels=in_channels, out_channels=int(_weight(state, "output.weight", path).shape[0]),
                  depth=depth, initial_features=initial_features, growth=growth,
                  pool_factors=pool_factors if depth else 2)
    for preset in PRESETS.values():
        unet = preset.unet_kwargs
        same_shape = all(unet[k] == config[k] for k in ("in_channels", "out_channels", "depth", "initial_features",
                                                         "growth"))
        if same_shape and _pool_list(unet["pool_factors"], depth) == pool_factors:
            logger.info("%s has the shapes of preset %r; taking its padding and activations", path, preset.name)
            config.update({k: unet[k] for k in ("padding", "activation", "final_activation")})
            break
    return config


def _pool_list(pool_factors, depth: int) -> list[tuple[int, ...]]:
    return [tuple(f) for f in _normalise_pool_factors(pool_factors, depth)]


def load_strict(module: nn.Module, state: Mapping, source: str, what: str) -> None:
    """Load ``state`` into ``module`` strictly; a mismatch names ``source`` and ``what`` it should fit."""
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())
        if len(detail) > 400:
            detail = detail[:400] + "..."
        raise ModelLoadError(f"{source} does not fit {what}: {detail}") from exc

