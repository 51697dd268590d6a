"""The README stays short and keeps CI's test command; the docs site (docs/, mkdocs.yml) builds without a warning."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci import missing

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 350


def test_the_docs_site_builds_strictly_without_a_warning(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        missing("mkdocs (the test extra: pip install -e '.[test]')")
    # Material prints a banner about MkDocs 2.0 on every build; it is no warning of ours.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d",
         str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "WARNING" not in output, output[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()


def test_the_readme_is_short_and_keeps_the_test_command_after_its_marker():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; at most {MAX_README_LINES}"
    # .ci/run takes the second line after the marker: awk '/<!-- test-command -->/{getline; getline; print; exit}'
    marker = lines.index("<!-- test-command -->")
    fence, command, closing = lines[marker + 1:marker + 4]
    assert fence.startswith("```"), fence
    assert command.strip() and not command.startswith("```"), command
    assert "pytest" in command, command
    assert closing == "```", closing


def test_the_readme_links_only_to_files_that_exist():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [target for target in targets if "://" not in target]
    assert local, "the README links to nothing in the repository"
    missing = [target for target in local if not (ROOT / target).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
