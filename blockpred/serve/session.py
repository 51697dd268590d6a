"""The run behind ``blockpred serve``: checked, planned and owned as ``blockpred run`` does, then fed on request.

:func:`open_session` takes the same input, output and options as
:func:`blockpred.predict`, runs the same checks and the same :func:`prepare`
(model, halo, block, batch, precision, backend, normalisation: the served chunk
is bit-for-bit the chunk ``blockpred run`` writes), takes the output's lock and
creates (or resumes) the output with its markers.  Instead of running every
block it opens the run's pipeline as a :class:`blockpred.pipeline.job.JobStream`
(newest first), which the server feeds one block per request.  Without an
output the prediction goes into a fresh folder under the system's temporary
directory, removed when the server stops; with one, every block viewed is a
block a later ``blockpred run`` of the same options skips.

The server runs in this process (one device).  ``--workers``, ``--scheduler``
and ``--cluster`` are refused in one line.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..cache import digest
from ..errors import InvalidOptionError
from ..geometry import Box
from ..io import Volume, VolumePath, open_volume
from ..pipeline.backoff import Backoff
from ..pipeline.job import Job, JobStream
from ..pipeline.markers import lock_path, markers_path
from ..run.formats import model_key_of
from ..run.output import create_output
from ..run.prepare import prepare, resolve_paths
from ..run.prepared import Prepared
from ..run.runner import _take_lock


@dataclass
class Session:
    """An opened run: what the server serves and feeds."""

    prepared: Prepared
    job: Job
    stream: JobStream
    target_path: VolumePath
    #: The run's fingerprint, short: the served URLs' first part (a changed model or option, a new URL).
    fingerprint: str
    #: True when the output is a temporary one (removed when the server stops).
    temporary: bool
    input_volume: Volume
    output_volume: Volume

    def read_output(self, box: Box) -> np.ndarray:
        return self.output_volume.read(box)

    def read_input(self, box: Box) -> np.ndarray:
        return self.input_volume.read(box)


@contextlib.contextmanager
def open_session(input, output, config, options: dict[str, Any]) -> Iterator[Session]:
    """The run of ``input`` into ``output`` (None: a temporary one) with ``options``, open for serving."""
    for name in ("workers", "scheduler", "cluster"):
        if options.get(name):
            raise InvalidOptionError(f"blockpred serve runs the network in its own process; drop --{name}")
    temporary = output is None
    with contextlib.ExitStack() as stack:
        if temporary:
            folder = Path(tempfile.mkdtemp(prefix="blockpred-serve-"))
            stack.callback(shutil.rmtree, folder, True)
            output = str(folder / "prediction.zarr")
        cfg, source_path, target_path = resolve_paths(input, output, config, {**options, "local": True})
        with open_volume(source_path) as source:
            p = prepare(cfg, source, source_path, target_path)
            lock = stack.enter_context(_take_lock(lock_path(markers_path(target_path)), str(target_path)))
            markers = create_output(p, source, owner=lock.token)
            stack.callback(markers.close)
        job = Job(source_path.absolute(), target_path.absolute(), markers, p.layout.plan, p.settings, p.spec,
                  device=cfg.device, precision=p.cfg.precision, compile=cfg.compile, memory_format=p.memory_format,
                  skip_empty=cfg.skip_empty, tta=cfg.tta, backend=p.backend, backend_key=model_key_of(p.cfg, p.model))
        stream = JobStream(job, p.predictor, Backoff(job.settings.batch_size), newest_first=True)
        stack.callback(markers.flush, quiet=True)  # after the pipeline stops (the stack unwinds last in, first out)
        stack.callback(stream.close, cancel=True)
        yield Session(p, job, stream, target_path, digest(p.fingerprint)[:16], temporary,
                      stack.enter_context(open_volume(source_path)), stack.enter_context(open_volume(target_path)))
