"""blockpred's cache directory and its JSON files (size trials, throughputs).

The directory is ``$BLOCKPRED_CACHE_DIR``, else ``$XDG_CACHE_HOME/blockpred``,
else ``~/.cache/blockpred``.  A file is read whole (a missing or broken one
reads as empty) and replaced whole, through a temporary file renamed into
place, so a reader never sees half of one; a home that cannot be written
logs a warning and never stops a run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    if os.environ.get("BLOCKPRED_CACHE_DIR"):
        return Path(os.environ["BLOCKPRED_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blockpred"


class JsonFile:
    """One JSON object in a file of the cache directory."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> dict:
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return entries if isinstance(entries, dict) else {}

    def write(self, entries: dict, what: str) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(entries, indent=1))
            os.replace(tmp, self.path)
        except OSError as err:  # a read-only home must not stop a run
            logger.warning("could not cache %s in %s: %s", what, self.path, err)

    def merge(self, entries: dict, what: str) -> None:
        """``entries`` added to the file's (replacing those of the same name)."""
        self.write({**self.read(), **entries}, what)


def digest(key) -> str:
    """A short name for a cache key (any JSON-able value): the first 32 hex digits of its sorted JSON's sha256."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
