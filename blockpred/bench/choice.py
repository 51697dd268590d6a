"""What ``blockpred run`` would choose, for ``blockpred bench``: the run's own checks and planning over the volume
bench was given (``--input``), or over a synthetic one of ``--volume-shape``.

Bench times the block, halo, batch, precision, memory format and backend that a run with the same model options
would take.  It gets them from the run itself: :func:`blockpred.run.prepare.resolve_paths` and
:func:`~blockpred.run.prepare.prepare` (its measured defaults, its ``auto`` trials, its precision check and
caches) on that volume, writing nothing (the output is named in a temporary directory and never created).

What can still differ from a run's choice, and why:

* the measured defaults are timed on this machine: a search that its run's budget cut short is cached as
  incomplete, and the next run (this bench's, or a run after it) goes on with it, so a run after bench may take a
  larger block or batch than bench timed (once the search is cached complete, both take it);
* without ``--input`` the synthetic uint8 volume stands for the run's: another shape gives the run another
  estimate (its blocks) and so another measuring budget, another data type other memory and normalisation;
* bench takes the run's model options only: a run's ``--roi``, ``--output-chunks`` or ``--shards`` (its block's
  step), ``--readers``/``--writers`` or ``--prefetch`` (the CPU's host-memory budget) are the run's defaults here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..geometry import Coord

#: The synthetic volume's shape where neither ``--input`` nor ``--volume-shape`` names one.
DEFAULT_VOLUME_SHAPE = Coord((128, 256, 256))


@dataclass(frozen=True)
class BenchVolume:
    """The volume bench chooses for: ``--input``'s shape and data type, else a synthetic uint8 one."""

    shape: Coord
    dtype: str
    #: Its channels (None: one, without a channel axis).
    num_channels: int | None = None
    #: ``--input`` as given; None: synthetic.
    path: str | None = None

    def __str__(self) -> str:
        return f"{'x'.join(map(str, self.shape))} {self.dtype} ({self.path or 'synthetic'})"

    def as_dict(self) -> dict:
        return {"path": self.path, "shape": list(self.shape), "dtype": self.dtype, "channels": self.num_channels,
                "synthetic": self.path is None}


def bench_volume(input_path: str | None, volume_shape: Coord | None, in_channels: int | None) -> BenchVolume:
    """``--input``'s shape, data type and channels (it is only opened), else a synthetic uint8 volume of
    ``volume_shape`` with the network's ``in_channels``."""
    if input_path is None:
        channels = in_channels if in_channels is not None and in_channels > 1 else None
        return BenchVolume(volume_shape or DEFAULT_VOLUME_SHAPE, "uint8", channels)
    from ..io import open_volume, parse_volume_path

    with open_volume(parse_volume_path(input_path)) as source:
        return BenchVolume(Coord(source.spatial_shape), str(source.dtype), source.num_channels, str(input_path))


@dataclass(frozen=True)
class RunChoice:
    """What ``blockpred run`` chooses over a volume (:func:`run_choice`)."""

    block: Coord
    halo: Coord
    batch_size: int
    memory_format: str
    #: The run's own words for the choice (its measured defaults' or auto sizes' line, its halo's, its precision's).
    how: str
    backend: str
    precision: str
    downsampling: Coord


def run_choice(options: dict, volume: BenchVolume) -> RunChoice:
    """What ``blockpred run INPUT`` with ``options`` (the keywords of :func:`blockpred.predict`; what is named stays
    named) chooses over ``volume``: the run's own paths, checks and planning, the same functions a run calls.

    A synthetic volume is a zarr of its shape, data type and channels in a temporary directory: empty (its reads
    are of zeros), or a synthetic EM volume where the run compares a low precision with fp32 on its first block
    (:func:`_checks_first_block`), since that comparison is cached for the network and later runs take it.  The
    run's output is named in that directory and never created.
    """
    import tempfile
    from pathlib import Path

    from ..io import create_volume, open_volume, parse_volume_path
    from ..io.synthetic import write_em_volume
    from ..run.prepare import prepare, resolve_paths

    with tempfile.TemporaryDirectory(prefix="blockpred-bench-") as workdir:
        source = volume.path
        if source is None:
            source = str(Path(workdir) / "region.zarr")
            if volume.num_channels is None and _checks_first_block(options):
                write_em_volume(source, volume.shape)
            else:
                create_volume(parse_volume_path(source), spatial_shape=volume.shape, num_channels=volume.num_channels,
                              dtype=volume.dtype, chunk_shape=tuple(min(64, s) for s in volume.shape),
                              ome=False).close()
        cfg, source_path, target_path = resolve_paths(source, str(Path(workdir) / "out.zarr"), None,
                                                      {**options, "progress": False})
        with open_volume(source_path) as opened:
            p = prepare(cfg, opened, source_path, target_path)
    sizes = f"auto size {p.layout.sizing}" if p.layout.sizing is not None and p.defaults is None else ""
    how = "; ".join(filter(None, [f"chosen {p.defaults}" if p.defaults is not None else sizes,
                                  p.layout.halo.note() if p.layout.halo is not None else "",
                                  f"precision {p.precision_note}" if p.precision_note else ""]))
    return RunChoice(p.layout.plan.block_shape, p.layout.plan.halo, p.settings.batch_size, p.memory_format, how,
                     p.backend, p.cfg.precision, p.layout.downsampling)


def _checks_first_block(options: dict) -> bool:
    """Whether a run with ``options`` compares its precision with fp32 on the volume's first block: ``auto`` on
    CUDA, a named fp16 or bf16 on the CPU (see :func:`blockpred.run.prepare.prepare`; fp16 or bf16 on CUDA too,
    where nothing is read: an EM volume costs it only its writing)."""
    from ..pipeline import resolve_device

    precision = options.get("precision") or "auto"
    if precision in ("fp16", "bf16"):
        return True
    return precision == "auto" and resolve_device(options.get("device") or "auto").type == "cuda"
