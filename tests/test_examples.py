"""The cluster examples and configs: they load, parse and import (no cluster, no dask-jobqueue needed)."""

import os
import importlib.util
import sys
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
    spec.loader.exec_module(module)  # blockpred and dask_jobqueue are imported only inside main()
    assert callable(module.main)
    args = module.parse_args(["/shared/vol.zarr/raw", "--jobs", "3", "--partition", "gpu", "--account", "lab"])
    assert (args.input, args.output, args.jobs, args.partition, args.account) == ("/shared/vol.zarr/raw", None, 3, "gpu", "lab")


def test_slurm_jobqueue_config_parses_and_its_settings_reach_the_job_script(tmp_path, monkeypatch):
    from blockpred.cluster.jobqueue import JobSettings, _make_cluster

    config = yaml.safe_load((ROOT / "configs" / "slurm.yaml").read_text())
    assert config["jobqueue"]["slurm"]["cores"] == 8
    monkeypatch.chdir(tmp_path)
    settings = JobSettings(system="slurm", jobs=1, gpus_per_job=1,  # the scheduler on loopback: nothing submitted
                           options={"queue": "gpu", "cores": 4, "scheduler_options": {"host": "127.0.0.1"}},
                           config_file=str(ROOT / "configs" / "slurm.yaml"))
    cluster = _make_cluster(settings, "blockpred-test", 50, lambda shared: shared)
    try:
        script = cluster.job_script()
    finally:
        cluster.close()
    assert "-p gpu" in script and "--cpus-per-task=4" in script  # the flags win over the file
    assert "--mem=60G" in script or "--mem=64G" in script  # the file's memory (dask-jobqueue rounds it down)
    assert "--gres=gpu:1" in script and "--nthreads 2" in script and "-t 04:00:00" in script
    assert "export OMP_NUM_THREADS=4" in script and "MALLOC_ARENA_MAX" not in script  # a GPU job
    assert "--protocol tls://" in script and "-J blockpred-test" in script
    assert script.strip().splitlines()[-1].startswith(f"exec {sys.executable} -m distributed.cli.dask_worker")


def test_a_child_python_of_the_tests_keeps_the_packages_found_through_pythonpath(monkeypatch, tmp_path):
    """On the GPU machine the dependencies are found through PYTHONPATH (pip --target): children must keep it."""
    from tests.helpers import ROOT, child_env

    monkeypatch.setenv("PYTHONPATH", f"/opt/site{os.pathsep}/opt/more")
    assert child_env()["PYTHONPATH"] == os.pathsep.join([str(ROOT), "/opt/site", "/opt/more"])
    assert child_env(tmp_path)["PYTHONPATH"] == os.pathsep.join([str(tmp_path), "/opt/site", "/opt/more"])
