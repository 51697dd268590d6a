"""``inferno.extensions.layers.convolutional``: ConvActivation and its named family.

``ConvActivation`` is a convolution (attribute ``conv``; 'same' zero padding of ``(kernel - 1) // 2 * dilation``
unless ``valid_conv``; a transposed one for ``deconv``) followed by an activation (attribute ``activation``: a torch
layer named by a string, a module, or None).  The family is inferno's names: ``{Conv, ValidConv, Deconv,
StridedConv, DilatedConv}{ReLU, ELU, Sigmoid, SELU, }{1D, 2D, 3D, ND}`` (``Conv2D`` has no activation,
``ConvELU3D`` an ELU, ``Deconv2D`` a 2x2 transposed convolution of stride 2, ``StridedConv`` stride 2,
``DilatedConv`` dilation 2), and ``BNReLU{Conv, Deconv, StridedConv, DilatedConv}{2D, 3D, ND}``: batch norm of the
input (attribute ``batchnorm``), ReLU, then the convolution.  Each takes ``in_channels, out_channels, kernel_size``
and ConvActivation's keywords.  inferno initialised the weights (orthogonal, He); here torch's defaults do, since a
published model's weights are loaded over them.  A BNReLU layer's batch norm is a torch ``BatchNorm{dim}d`` as in
inferno's releases up to 2019; the later layout (``batchnorm.bn.*``) loads into it too.
"""

import torch.nn as nn

__all__ = ["ConvActivation", "ConvActivationND"]


class ConvActivation(nn.Module):
    """A convolution with 'same' padding by default, followed by an activation."""

    def __init__(self, in_channels, out_channels, kernel_size, dim, activation, stride=1, dilation=1, groups=None,
                 depthwise=False, bias=True, deconv=False, initialization=None, valid_conv=False):
        super().__init__()
        if dim not in (1, 2, 3):
            raise ValueError(f"`dim` must be one of [1, 2, 3], got {dim}.")
        self.dim = dim
        if depthwise:
            out_channels = in_channels if out_channels in (None, "auto") else out_channels
            if in_channels != out_channels or (groups is not None and groups != in_channels):
                raise ValueError(f"a depthwise convolution takes as many output channels and groups as input "
                                 f"channels ({in_channels}), got {out_channels} and {groups}")
            groups = in_channels
        else:
            groups = 1 if groups is None else groups
        self.depthwise = depthwise
        common = dict(in_channels=in_channels, out_channels=out_channels, kernel_size=kernel_size, stride=stride,
                      dilation=dilation, groups=groups, bias=bias)
        if deconv:
            self.conv = getattr(nn, f"ConvTranspose{dim}d")(**common)
        elif valid_conv:
            self.conv = getattr(nn, f"Conv{dim}d")(**common)
        else:
            self.conv = getattr(nn, f"Conv{dim}d")(padding=self.get_padding(kernel_size, dilation), **common)
        if isinstance(activation, str):
            self.activation = getattr(nn, activation)()
        elif activation is None or isinstance(activation, nn.Module):
            self.activation = activation
        else:
            raise TypeError(f"activation must be a torch layer's name, a module or None, got {activation!r}")

    def forward(self, input):
        conved = self.conv(input)
        return conved if self.activation is None else self.activation(conved)

    def _pair_or_triplet(self, value):
        if isinstance(value, (list, tuple)):
            if len(value) != self.dim:
                raise ValueError(f"expected {self.dim} values, got {value!r}")
            return list(value)
        return [value] * self.dim

    def get_padding(self, kernel_size, dilation):
        """'Same' padding: ``(kernel - 1) // 2 * dilation`` per axis (odd kernels)."""
        padding = []
        for kernel, dilated in zip(self._pair_or_triplet(kernel_size), self._pair_or_triplet(dilation)):
            if kernel % 2 != 1:
                raise ValueError(f"'same' padding needs an odd kernel size, got {kernel_size!r}")
            padding.append((kernel - 1) // 2 * dilated)
        return tuple(padding)


ConvActivationND = ConvActivation


class _BNReLUConv(ConvActivation):
    """Batch norm of the input, ReLU, then the convolution."""

    def __init__(self, in_channels, out_channels, kernel_size, dim, **kwargs):
        super().__init__(in_channels, out_channels, kernel_size, dim, activation=nn.ReLU(inplace=True), **kwargs)
        self.batchnorm = getattr(nn, f"BatchNorm{dim}d")(in_channels)
        self._register_load_state_dict_pre_hook(_bn_keys)

    def forward(self, input):
        return self.conv(self.activation(self.batchnorm(input)))


def _bn_keys(state_dict, prefix, *args):
    """Later inferno kept the batch norm one level down (``batchnorm.bn.*``): its keys load here too."""
    for key in [k for k in state_dict if k.startswith(prefix + "batchnorm.bn.")]:
        state_dict[prefix + "batchnorm." + key[len(prefix + "batchnorm.bn."):]] = state_dict.pop(key)


def _family(base, name, fixed, defaults):
    """A class ``name``: ``base`` with ``fixed`` keywords and ``defaults`` (kernel_size among them, optionally)."""

    def __init__(self, in_channels, out_channels=None, kernel_size=None, **kwargs):
        given = {**defaults, **{k: v for k, v in (("kernel_size", kernel_size),) if v is not None}, **kwargs}
        base.__init__(self, in_channels, out_channels, dim=fixed["dim"], **given,
                      **{k: v for k, v in fixed.items() if k != "dim"})

    def __init_nd__(self, in_channels, out_channels=None, kernel_size=None, dim=None, **kwargs):
        given = {**defaults, **{k: v for k, v in (("kernel_size", kernel_size),) if v is not None}, **kwargs}
        base.__init__(self, in_channels, out_channels, dim=dim, **given, **fixed)

    return type(name, (base,), {"__init__": __init__ if "dim" in fixed else __init_nd__,
                                "__doc__": f"inferno's {name}: {base.__name__} with {fixed or 'no fixed options'}"
                                           f"{f', defaults {defaults}' if defaults else ''}."})


_CONVS = {"Conv": ({}, {}), "ValidConv": ({"valid_conv": True}, {}),
          "Deconv": ({"deconv": True}, {"kernel_size": 2, "stride": 2}),
          "StridedConv": ({}, {"stride": 2}), "DilatedConv": ({}, {"dilation": 2})}
_ACTIVATIONS = {"ReLU": "ReLU", "ELU": "ELU", "Sigmoid": "Sigmoid", "SELU": "SELU", "": None}

for _conv, (_fixed, _defaults) in _CONVS.items():
    for _name, _activation in _ACTIVATIONS.items():
        for _dim in ("ND", 1, 2, 3):
            _cls = f"{_conv}{_name}{_dim}{'D' if _dim != 'ND' else ''}"
            _fix = {**_fixed, "activation": _activation} if _name else dict(_fixed)
            _default = dict(_defaults) if _name else {**_defaults, "activation": None}
            if _dim != "ND":
                _fix["dim"] = _dim
            globals()[_cls] = _family(ConvActivation, _cls, _fix, _default)
            __all__.append(_cls)
    for _dim in ("ND", 1, 2, 3):
        _cls = f"BNReLU{_conv}{_dim}{'D' if _dim != 'ND' else ''}"
        _fix = dict(_fixed) if _dim == "ND" else {**_fixed, "dim": _dim}
        globals()[_cls] = _family(_BNReLUConv, _cls, _fix, dict(_defaults))
        __all__.append(_cls)
