"""``--memory-format auto``: measured once per network and device, cached, never overriding a named layout."""

import numpy as np

import blockpred
from blockpred.cli import main
from blockpred.io import open_volume
from tests.helpers import write_test_volume


def _read(path: str) -> np.ndarray:
    volume = open_volume(path)
    return volume.read(volume.box)


def test_auto_measures_once_then_uses_the_cache_and_predicts_what_contiguous_does(tmp_path):
    data = np.random.default_rng(7).integers(0, 255, (16, 32, 48), dtype=np.uint8)
    source = write_test_volume(str(tmp_path / "in.zarr"), data)
    options = dict(block=16, halo=4, precision="fp32", local=True, progress=False)
    first = blockpred.predict(source, str(tmp_path / "auto1.zarr"), memory_format="auto", **options)
    second = blockpred.predict(source, str(tmp_path / "auto2.zarr"), memory_format="auto", **options)
    plain = blockpred.predict(source, str(tmp_path / "plain.zarr"), memory_format="contiguous", **options)
    assert first.memory_format is not None and not first.memory_format.cached
    assert set(first.memory_format.seconds) == {"contiguous", "channels_last"}
    assert second.memory_format.cached and second.memory_format.memory_format == first.memory_format.memory_format
    assert "memory format: " in str(first) and "; measured)" in str(first) and "; cached)" in str(second)
    assert plain.memory_format is None and "memory format" not in str(plain)  # a named layout is never measured
    np.testing.assert_allclose(_read(first.output), _read(plain.output), atol=1e-5)


def test_auto_with_compile_is_refused_in_one_line(tmp_path, capsys):
    source = write_test_volume(str(tmp_path / "in.zarr"), np.ones((16, 16, 16), dtype=np.uint8))
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["run", source, str(tmp_path / "out.zarr"), "--local", "--memory-format", "auto",
                 "--compile", "default"]) == 2
    err = capsys.readouterr().err
    assert "--memory-format auto" in err and "--compile" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before
