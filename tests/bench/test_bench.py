"""`blockpred bench`: the printed tables and the JSON report."""

import json

import pytest

from blockpred.cli import main
from tests.ci import missing


def test_bench_prints_the_throughput_table_and_the_json_has_every_figure(tmp_path, capsys):
    report_path = tmp_path / "bench.json"
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--batch-size", "1,2", "--warmup", "1",
                 "--iterations", "2", "--block", "32", "--json", str(report_path)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    report = json.loads(report_path.read_text())
    assert report["environment"]["torch"] and len(report["results"]) == 2
    said = captured.err.splitlines()  # what the run would take, what is measured, on a CPU its estimate
    assert said[0].startswith("measuring tiny fp32: as `blockpred run` would over 128x256x256 uint8 (synthetic): "
                              "block 32x32x32")
    assert report["volume"] == {"path": None, "shape": [128, 256, 256], "dtype": "uint8", "channels": None,
                                "synthetic": True}
    assert "halo 10x10x10 the model's" in said[0]
    assert said[1].startswith("measuring tiny fp32: block (32, 32, 32) on the CPU, about ") and "of passes" in said[1]
    backend = report["results"][0]["backend"]  # the one the run chose (a CPU may run OpenVINO)
    assert said[2].startswith(f"measuring tiny {backend} fp32 batch 1: input (52, 52, 52)")
    table_rows = [line.split()[1:] for line in out.splitlines() if line.split()[:2] == [backend, "fp32"]]
    assert len(table_rows) == 2
    for row, result in zip(table_rows, report["results"]):
        assert int(row[1]) == result["batch_size"] and result["backend"] == backend
        assert float(row[2]) == pytest.approx(result["output_mvox_per_s"], abs=0.006)
        assert float(row[3]) == pytest.approx(result["input_mvox_per_s"], abs=0.006)
        for column, key in zip(row[4:9], ("mean_s", "p50_s", "p90_s", "p95_s", "p99_s")):
            assert float(column) == pytest.approx(result[key] * 1e3, abs=0.06)
        assert result["peak_memory_bytes"] > 0 and result["load"]["kind"] == "cpu"
        assert result["input_shape"] == [52, 52, 52] and result["block"] == [32, 32, 32]


def test_extrapolating_platynereis_at_12_7_mvox_per_s_takes_177_2_hours_on_one_gpu(capsys):
    assert main(["bench", "--extrapolate", "platynereis", "--assume-mvox-per-s", "12.7", "--gpus", "1,8"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("platynereis")]
    assert rows[0][2:4] == ["1", "177.2h"] and rows[1][2:4] == ["8", "22.1h"]


def test_a_bad_precision_list_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["bench", "--precision", "fp32,fp64"])
    assert ended.value.code == 2
    assert capsys.readouterr().err == ("blockpred: error: argument --precision: must be a comma-separated list of "
                                       "auto, fp32, tf32, fp16, bf16, got 'fp32,fp64' ('fp64' is none of them) "
                                       "(see 'blockpred bench --help')\n")


def test_bench_with_pipeline_and_training_reports_efficiency_stages_and_iterations(tmp_path, capsys):
    report_path, markdown = tmp_path / "bench.json", tmp_path / "bench.md"
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--block", "16", "--iterations", "2", "--warmup", "1",
                 "--pipeline", "--volume-shape", "16,32,32", "--workers", "1", "--train",
                 "--json", str(report_path), "--markdown", str(markdown)]) == 0
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    pipeline, training = report["pipeline"], report["training"]
    assert pipeline["num_blocks"] == 4 and pipeline["volume_shape"] == [16, 32, 32]
    assert pipeline["efficiency"] == pytest.approx(pipeline["mvox_per_s"] / pipeline["model_only_mvox_per_s"])
    assert pipeline["limiting_stage"] in ("read", "compute", "write")
    assert pipeline["transfer_s"] == 0.0  # no host-device copies on the CPU
    assert f"pipeline efficiency {pipeline['efficiency']:.2f}" in out
    assert training["iterations_per_minute"] > 0
    assert training["hours_per_100k_iterations"] == pytest.approx(100_000 / training["iterations_per_minute"] / 60)
    text = markdown.read_text()
    assert "| model | precision |" in text and "efficiency" in text and "iterations/min" in text


def test_bench_plots_throughput_against_batch_size(tmp_path):
    png = tmp_path / "bench.png"
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--block", "16", "--batch-size", "1,2",
                 "--precision", "fp32,bf16", "--iterations", "1", "--warmup", "1", "--volume-shape", "16,32,32",
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bench_refuses_a_block_off_the_networks_grid_as_run_does(capsys):
    """Found on the H100: bench timed cremi2018 at 55,576,576, then --pipeline refused that block."""
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--block", "15,16,16", "--iterations", "1"]) == 2
    err = capsys.readouterr().err
    assert "not a multiple of the network's downsampling (2, 2, 2)" in err and "--block 16,16,16" in err


def test_plot_without_matplotlib_is_refused_before_anything_is_measured(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed: import fails
    report = tmp_path / "b.json"
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--block", "16", "--iterations", "1",
                 "--json", str(report), "--plot", str(tmp_path / "b.png")]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == ('blockpred: error: --plot needs matplotlib: pip install -e ".[bench]" in '
                                    "blockpred's checkout (or pip install matplotlib)")
    assert captured.out == "" and not report.exists()  # nothing measured, nothing written


def test_bench_without_a_block_or_batch_times_what_the_run_chose(tmp_path, capsys):
    import numpy as np

    from tests.helpers import write_test_volume

    source = write_test_volume(str(tmp_path / "in.zarr"), np.random.default_rng(0).integers(0, 255, (32, 96, 96),
                                                                                           dtype=np.uint8))
    run = ["run", source, str(tmp_path / "out.zarr"), "--model", "tiny", "--device", "cpu", "--no-progress",
           "--json", "--overwrite"]
    assert main(run) == 0  # measures, and caches what it chose (a block it guessed, as its passes timed it)
    capsys.readouterr()
    report_path = tmp_path / "bench.json"
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--volume-shape", "32,96,96", "--warmup", "0",
                 "--iterations", "1", "--json", str(report_path)]) == 0
    assert "as `blockpred run` would over 32x96x96 uint8 (synthetic)" in capsys.readouterr().err
    assert main(run) == 0  # the run bench foresaw: from the same cache
    ran = json.loads(capsys.readouterr().out)
    result = json.loads(report_path.read_text())["results"][0]
    assert result["block"] == ran["block"] and result["batch_size"] == ran["batch_size"]


def test_bench_gives_a_row_per_backend_with_its_difference_from_torch(tmp_path, capsys):
    from blockpred.pipeline.backends import openvino_available

    if not openvino_available():
        missing("OpenVINO (a required dependency)")
    report_path = tmp_path / "bench.json"
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--backend", "torch,openvino", "--batch-size", "1",
                 "--warmup", "0", "--iterations", "1", "--block", "16", "--json", str(report_path)]) == 0
    results = json.loads(report_path.read_text())["results"]
    assert [r["backend"] for r in results] == ["torch", "openvino"]
    assert results[0]["max_diff"] == 0.0 and results[1]["max_diff"] <= 1e-5
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] in (["torch"], ["openvino"])]
    assert rows == ["torch", "openvino"]
