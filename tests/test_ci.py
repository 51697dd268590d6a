"""Under CI=true a test never skips for what the suite needs (tests/ci.py): it fails; elsewhere it skips."""

import subprocess
import sys
import textwrap

import pytest

from tests.helpers import child_env

NEEDY = textwrap.dedent("""
    from tests.ci import import_or_skip, missing, needs

    @needs(False, "a network nobody has")
    def test_marked():
        pass

    def test_imports():
        import_or_skip("blockpred_no_such_module")

    def test_says():
        missing("a file nobody wrote")
""")


def _pytest(folder, ci: bool) -> subprocess.CompletedProcess:
    env = {key: value for key, value in child_env().items() if key != "CI"}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--rootdir", str(folder), str(folder)], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("ci", [pytest.param(False, id="elsewhere"), pytest.param(True, id="CI=true")])
def test_a_missing_need_skips_elsewhere_and_fails_under_ci(tmp_path, ci):
    # The suite's own hook for the mark, not its session check: this test is about the tests, not this machine.
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_setup\n\n\n"
                                          "def pytest_configure(config):\n"
                                          "    config.addinivalue_line('markers', 'needs(present, what)')\n")
    (tmp_path / "test_needy.py").write_text(NEEDY)
    done = _pytest(tmp_path, ci)
    if ci:
        assert done.returncode == 1 and "2 failed, 1 error" in done.stdout, done.stdout  # the mark's: at set-up
        assert "a network nobody has is missing, and CI=true" in done.stdout
        assert "No module named 'blockpred_no_such_module'" in done.stdout
    else:
        assert done.returncode == 0 and "3 skipped" in done.stdout, done.stdout

