"""``inferno.extensions.layers``: every layer of the stand-in, as inferno's package exported them."""

from .activations import *  # noqa: F401,F403
from .convolutional import *  # noqa: F401,F403
from .normalization import *  # noqa: F401,F403
from .reshape import *  # noqa: F401,F403
from .sampling import *  # noqa: F401,F403
