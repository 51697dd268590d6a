"""What ``CI=true`` demands of the suite: nothing it needs may be missing, so nothing is skipped for it.

On a developer's machine a test whose needs are not there (an optional import,
``../shared/realdata`` beside the checkout) is skipped and says why.  On CI
(``CI=true``, as CI services set it) a skip for a missing requirement would
hide a whole part of the suite: there the same test fails instead, and
:func:`missing_requirements` makes the session fail before any test when a
required dependency (``pyproject.toml``'s ``[project]`` dependencies and its
``test`` extra) or ``../shared/realdata`` is missing.

What may still skip on CI is what CI's machine cannot have: a CUDA device
(``gpu`` tests), a SLURM without ``--slurm`` (``slurm`` tests), a CPU feature,
a file system or privilege the test names.

Only the standard library, pytest and packaging here: this runs before any
test module imports blockpred.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import tomllib
from pathlib import Path
from typing import NoReturn

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
#: Trained networks and real volumes nobody here wrote, beside the checkout (see its README).
REALDATA = ROOT.parent / "shared" / "realdata"
#: The environment variable CI services set (GitHub, GitLab, Jenkins' plugins ...).
ON_CI = os.environ.get("CI", "").strip().lower() in ("true", "1")


def missing(what: str) -> NoReturn:
    """The test needs ``what``, and it is not here: skipped, or on CI (where it must be) failed."""
    if ON_CI:
        pytest.fail(f"{what} is missing, and CI=true: a test may not skip for it there", pytrace=False)
    pytest.skip(f"{what} is missing")


def needs(present: bool, what: str) -> pytest.MarkDecorator:
    """A mark for a test (or, as ``pytestmark``, a module) that needs ``what``: where it is not ``present``, the
    test is :func:`missing` it (conftest acts on the mark)."""
    return pytest.mark.needs(present=bool(present), what=what)


def import_or_skip(name: str):
    """``pytest.importorskip(name)``; on CI a failing import is the failure it is (the module's collection error)."""
    if ON_CI:
        return importlib.import_module(name)
    return pytest.importorskip(name)


def _unmet(requirement: Requirement, extra: str | None = None) -> list[str]:
    """What of ``requirement`` (and of its extras, one level down) is not installed, as ``name (why)``."""
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra or ""}):
        return []
    try:
        distribution = importlib.metadata.distribution(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        return [f"{requirement} (not installed)"]
    if requirement.specifier and not requirement.specifier.contains(distribution.version, prereleases=True):
        return [f"{requirement} ({distribution.version} is installed)"]
    unmet = []
    for wanted in requirement.extras:
        for line in distribution.requires or ():
            needed = Requirement(line)
            if needed.marker is not None and "extra" in str(needed.marker):
                unmet += _unmet(needed, wanted)
    return unmet


def missing_requirements() -> list[str]:
    """What CI needs and is not here: required dependencies (and the test extra) not installed, and
    ``../shared/realdata`` not beside the checkout."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    unmet = [line for requirement in wanted for line in _unmet(Requirement(requirement))]
    if not REALDATA.is_dir():
        unmet.append(f"{REALDATA} (../shared/realdata beside the checkout)")
    return unmet
