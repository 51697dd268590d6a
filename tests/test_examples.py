"""The cluster examples and configs: they load, parse and import (no cluster, no dask-jobqueue needed)."""

import os
import importlib.util
from pathlib import Path

import yaml

from blockpred.config import make_config

ROOT = Path(__file__).resolve().parent.parent


def test_cluster_run_config_is_a_valid_blockpred_options_file():
    config = make_config(ROOT / "configs" / "cluster-run.yaml")
    assert config.scheduler.startswith("tcp://")
    assert config.precision == "bf16" and config.retries == 3
    assert not config.local and config.workers is None  # joins a cluster; starts none


def test_slurm_example_imports_without_dask_jobqueue_and_has_main():
    spec = importlib.util.spec_from_file_location("slurm_cluster_example", ROOT / "examples" / "slurm_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # dask_jobqueue is imported only inside make_cluster()
    assert callable(module.main)
    args = module.parse_args(["/shared/vol.zarr/raw", "--jobs", "3", "--partition", "gpu", "--account", "lab"])
    assert (args.input, args.output, args.jobs, args.partition, args.account) == ("/shared/vol.zarr/raw", None, 3, "gpu", "lab")
    assert module.JOB_SETTINGS["processes"] == 1 and "--gres=gpu:1" in module.JOB_SETTINGS["job_extra_directives"]


def test_slurm_jobqueue_config_parses():
    config = yaml.safe_load((ROOT / "configs" / "slurm.yaml").read_text())
    slurm = config["jobqueue"]["slurm"]
    assert slurm["processes"] == 1
    assert "--gres=gpu:1" in slurm["job-extra-directives"]
    assert slurm["worker-extra-args"] == ["--nthreads", "2"]


def test_a_child_python_of_the_tests_keeps_the_packages_found_through_pythonpath(monkeypatch, tmp_path):
    """On the GPU machine the dependencies are found through PYTHONPATH (pip --target): children must keep it."""
    from tests.helpers import ROOT, child_env

    monkeypatch.setenv("PYTHONPATH", f"/opt/site{os.pathsep}/opt/more")
    assert child_env()["PYTHONPATH"] == os.pathsep.join([str(ROOT), "/opt/site", "/opt/more"])
    assert child_env(tmp_path)["PYTHONPATH"] == os.pathsep.join([str(tmp_path), "/opt/site", "/opt/more"])
