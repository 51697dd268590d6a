"""cuDNN's kernel search around one pass: on for the passes that ask for it, as it was before for everything else
(who decides: :mod:`blockpred.tuning.search`)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def kernel_search(on: bool) -> Iterator[None]:
    """``torch.backends.cudnn.benchmark`` at ``on`` inside, restored after (a counted pass, the field's passes and
    a user's own calls that run the module directly never inherit a run's search)."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before
