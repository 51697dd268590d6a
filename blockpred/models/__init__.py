"""Networks and how to load them.

* :mod:`.unet`: :class:`UNet3d`, the built-in 3D U-Net;
* :mod:`.presets`: named UNet3d architectures with seeded weights and block/halo defaults;
* :mod:`.inferno`: :class:`InfernoUNet`, loads weights trained with inferno's UNet;
* :mod:`.loading`: :func:`load_model` turns ``--model``/``--weights`` into a :class:`LoadedModel`;
* :mod:`.torchfile`: reads model files safely (never runs code from a file the user did not trust);
* :mod:`.state_dicts`: recognises inferno UNet and UNet3d state dicts and builds the network they fit;
* :mod:`.receptive`: :func:`receptive_radius` measures how much context a network sees;
* :mod:`.bioimageio`: bioimage.io model packages (rdf.yaml / .zip); :mod:`.bioimageio_ops` their processing
  steps on the device; :mod:`.bioimageio_stats` the statistics of the volume those steps need,
  :mod:`.bioimageio_planes` a 2D package's per-plane ones; :mod:`.check` a package's test tensors reproduced.
"""

from .inferno import InfernoUNet
from .loading import LoadedModel, load_model
from .presets import PRESETS, Preset, build_preset, get_preset
from .receptive import receptive_radius
from .unet import UNet3d

__all__ = [
    "InfernoUNet",
    "LoadedModel",
    "PRESETS",
    "Preset",
    "UNet3d",
    "build_preset",
    "get_preset",
    "load_model",
    "receptive_radius",
]
