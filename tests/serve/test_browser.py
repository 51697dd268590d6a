"""``blockpred serve`` in a real browser: headless Chromium runs neuroglancer's client on a served prediction.

neuroglancer's own client (the ``neuroglancer`` package's viewer, driven by its webdriver helper through
Chromium and chromedriver) loads the prediction layer's chunks from the server; its values, read back through
that client, equal ``blockpred run``'s output, and a screenshot is saved (``BLOCKPRED_SCREENSHOT``: also copied
there).  Skipped where Chromium, chromedriver, selenium or neuroglancer is missing (``.ci/run`` installs them).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import blockpred
from blockpred.geometry import Coord
from blockpred.io import open_volume
from blockpred.io.synthetic import make_em_volume
from blockpred.serve import serving
from tests.ci import import_or_skip
from tests.helpers import write_test_volume

neuroglancer = import_or_skip("neuroglancer")
import_or_skip("neuroglancer.webdriver")
import_or_skip("selenium")
# Chromium is no Python package: .ci/run installs it (from apt) before the suite; elsewhere its absence is a skip.
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None or shutil.which("chromedriver") is None,
                                reason="needs Chromium and chromedriver (apt install chromium chromium-driver)")

PINNED = dict(model="tiny", block=(16, 32, 32), halo=(10, 10, 10), batch_size=1, device="cpu", backend="torch",
              memory_format="contiguous", progress=False)


def test_neuroglancer_in_chromium_loads_the_served_chunks_and_they_are_the_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("SE_OFFLINE", "true")  # selenium uses the chromedriver on PATH, never a download
    data = make_em_volume(Coord((16, 96, 96)), num_cells=12)
    volume = write_test_volume(str(tmp_path / "v.zarr"), data, voxel_size=(8.0, 4.0, 4.0))
    neuroglancer.set_server_bind_address("127.0.0.1")
    viewer = neuroglancer.Viewer()
    origin = "/".join(viewer.get_viewer_url().split("/")[:3])
    with serving(volume, None, cors_origins=(origin,), **PINNED) as served:
        with viewer.txn() as state:
            state.layers["raw"] = neuroglancer.ImageLayer(source=f"zarr://{served.raw_url}")
            state.layers["prediction"] = neuroglancer.ImageLayer(
                source=f"zarr://{served.prediction_url}", opacity=0.6,
                shader="#uicontrol invlerp normalized\nvoid main() { emitRGB(vec3(normalized(), 0.0, 0.0)); }")
            state.cross_section_scale = 0.9
            state.layout = "yz"  # the global dimensions are (z, y, x), as the axes are: its 2nd and 3rd, a section
        from neuroglancer.webdriver import Webdriver

        with Webdriver(viewer, headless=True, browser="chrome", browser_binary_path=CHROMIUM, docker=True,
                       print_logs=False, window_size=(800, 600),
                       extra_command_line_args=["--enable-unsafe-swiftshader", "--use-angle=swiftshader"]) as driver:
            driver.sync()
            shot = viewer.screenshot(size=[640, 480])  # the client answers once the visible chunks are loaded
            store = viewer.volume("prediction").result()  # read through the client, in its dimensions
            labels = [label.rstrip("'^") for label in store.domain.labels]
            seen = np.asarray(store.read().result())
        counts = served.work.counts.as_dict()
    png = shot.screenshot.image
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and shot.screenshot.width == 640
    (tmp_path / "serve.png").write_bytes(png)
    if os.environ.get("BLOCKPRED_SCREENSHOT"):
        shutil.copyfile(tmp_path / "serve.png", os.environ["BLOCKPRED_SCREENSHOT"])
    summary = blockpred.predict(volume, str(tmp_path / "run.zarr"), **PINNED)
    written = open_volume(summary.output)
    expected = written.read(written.box)  # (c, z, y, x)
    np.testing.assert_array_equal(np.transpose(seen, [labels.index(axis) for axis in "czyx"]), expected)
    assert counts["blocks_predicted"] == summary.plan.num_blocks and counts["requests"] >= summary.plan.num_blocks
