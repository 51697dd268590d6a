"""Draw blockpred's data flow and write it to ``docs/dataflow.svg`` (embedded in README.md and docs/index.md).

Run it again after changing the picture: ``python docs/make_dataflow.py``.  Text stays text in the SVG
(``svg.fonttype: none``) and the file carries no date or random ids, so it is small and the same every run.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

OUT_PATH = Path(__file__).resolve().parent / "dataflow.svg"

CLIENT_COLOR = "#dbe8f6"
WORKER_COLOR = "#e3f1df"
DEVICE_COLOR = "#fbe3c8"
STORE_COLOR = "#eeeeee"
EDGE_COLOR = "#444444"


def box(ax, center_x, center_y, width, height, text, color, fontsize=9, weight="normal"):
    """A rounded box centred at (center_x, center_y) with its label; returns its (left, right, bottom, top)."""
    left, bottom = center_x - width / 2, center_y - height / 2
    ax.add_patch(FancyBboxPatch((left, bottom), width, height, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=color, edgecolor=EDGE_COLOR, linewidth=1))
    ax.text(center_x, center_y, text, ha="center", va="center", fontsize=fontsize, weight=weight, wrap=True)
    return left, left + width, bottom, bottom + height


def arrow(ax, begin, end, label=None, label_offset=(0.0, 0.12)):
    ax.annotate("", xy=end, xytext=begin,
                arrowprops={"arrowstyle": "-|>", "color": EDGE_COLOR, "linewidth": 1.2, "shrinkA": 0, "shrinkB": 0})
    if label:
        ax.text((begin[0] + end[0]) / 2 + label_offset[0], (begin[1] + end[1]) / 2 + label_offset[1], label,
                ha="center", va="bottom", fontsize=7.5, style="italic", color="#333333")


def draw():
    plt.rcParams["svg.fonttype"] = "none"  # text as <text>, not glyph paths: a few KB instead of hundreds
    plt.rcParams["svg.hashsalt"] = "blockpred-dataflow"  # stable element ids
    plt.rcParams["font.family"] = "DejaVu Sans"
    figure, ax = plt.subplots(figsize=(12, 4.6))
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 4.6)
    ax.axis("off")

    # The client: one process plans the run, then hands blocks to the workers.
    ax.text(0.15, 4.42, "client (blockpred run / blockpred.predict)", fontsize=9.5, weight="bold", va="center")
    height = 0.8
    row_y = 3.7
    config = box(ax, 1.0, row_y, 1.7, height, "config\nCLI flags, YAML or\nPython keywords", CLIENT_COLOR)
    prepare = box(ax, 3.55, row_y, 2.3, height, "run: prepare\nevery check,\nwrites nothing", CLIENT_COLOR)
    choose = box(ax, 6.45, row_y, 2.4, height, "choose block, halo, batch:\nnamed, the model's, cached\nor measured defaults",
                 CLIENT_COLOR)
    scheduler = box(ax, 10.0, row_y, 2.9, height, "dask scheduler:\nblocks to GPU workers, retries\n(one device: in process)",
                    CLIENT_COLOR)
    arrow(ax, (config[1], row_y), (prepare[0], row_y))
    arrow(ax, (prepare[1], row_y), (choose[0], row_y))
    arrow(ax, (choose[1], row_y), (scheduler[0], row_y))

    # One worker (one per GPU): its pipeline, from the stored volume to the written chunks and markers.
    ax.add_patch(FancyBboxPatch((1.55, 0.35), 10.3, 2.25, boxstyle="round,pad=0.02,rounding_size=0.12",
                                facecolor="none", edgecolor="#999999", linewidth=1, linestyle="--"))
    ax.text(1.7, 2.42, "each worker (one per GPU): one pipeline, bounded queues", fontsize=9.5, weight="bold",
            va="center")
    arrow(ax, (10.0, scheduler[2]), (10.0, 2.62), label="block ids, task by task", label_offset=(-1.1, -0.12))

    flow_y = 1.4
    height = 1.2
    volume = box(ax, 0.7, flow_y, 1.2, height, "volume\nzarr / N5\nHDF5 / TIFF\nprecomputed\nlocal or S3",
                 STORE_COLOR, fontsize=8.5)
    read = box(ax, 2.7, flow_y, 1.7, height, "padded blocks\nread with a halo\n(prefetch threads)", WORKER_COLOR)
    network = box(ax, 4.95, flow_y, 1.6, height, "network\non the device\n(batches)", DEVICE_COLOR, weight="bold")
    crop = box(ax, 6.95, flow_y, 1.2, height, "halo\ncropped", DEVICE_COLOR)
    write = box(ax, 8.95, flow_y, 1.7, height, "output chunks\nwritten once\n(writer threads)", WORKER_COLOR)
    markers = box(ax, 11.0, flow_y, 1.2, height, "done\nmarkers\n(resume)", STORE_COLOR, fontsize=8.5)
    arrow(ax, (volume[1], flow_y), (read[0], flow_y))
    arrow(ax, (read[1], flow_y), (network[0], flow_y), label="upload")
    arrow(ax, (network[1], flow_y), (crop[0], flow_y))
    arrow(ax, (crop[1], flow_y), (write[0], flow_y), label="download")
    arrow(ax, (write[1], flow_y), (markers[0], flow_y), label="committed")

    figure.savefig(OUT_PATH, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    plt.close(figure)
    return OUT_PATH


if __name__ == "__main__":
    path = draw()
    print(f"wrote {path} ({path.stat().st_size / 1024:.1f} KiB)")
