"""``blockpred serve`` as a command: the lines it prints, the viewer it opens, the warning an open host gets."""

from __future__ import annotations

import sys
from typing import Any

from ..errors import InvalidOptionError
from . import LOCAL_HOSTS, serve, viewer
from .http import DEFAULT_ORIGINS


def serve_command(input: str, output: str | None, *, config: str | None, options: dict[str, Any], host: str,
                  port: int, cache_mb: float, open_viewer: bool, cors_origins: list[str] | None) -> int:
    """Serve until Ctrl-C or SIGTERM (then :func:`blockpred.cli.main` prints the one line and exits 130 or 143)."""
    if not 0 <= port <= 65535:
        raise InvalidOptionError(f"--port must be between 0 and 65535 (0: any free port), got {port}")
    if cache_mb < 0:
        raise InvalidOptionError(f"--cache-mb must be 0 or more, got {cache_mb:g}")
    if host not in LOCAL_HOSTS:
        print(f"blockpred: warning: serving on {host}: anyone who can reach port {port} there can read the input "
              f"and the prediction (the server has no login)", file=sys.stderr, flush=True)
    origins = list(cors_origins) if cors_origins else list(DEFAULT_ORIGINS)
    local_viewer = viewer.start_viewer() if open_viewer else None
    if local_viewer is not None:
        origins.append(viewer.origin(local_viewer.get_viewer_url()))

    def ready(served) -> None:
        lines = [f"blockpred: serving {input} predicted by {served.session.prepared.model.name}, block "
                 f"{'x'.join(map(str, served.work.plan.block_shape))} (each block predicted when first looked at"
                 + (f", and written to {served.session.target_path})" if not served.session.temporary else ")"),
                 f"  prediction: zarr://{served.prediction_url}",
                 f"  raw:        zarr://{served.raw_url}"]
        if local_viewer is not None:
            lines.append(f"  viewer:     {viewer.show(local_viewer, served)}")
        elif served.neuroglancer is not None:
            lines.append(f"  neuroglancer: {served.neuroglancer}")
        else:
            lines.append("  (add the two zarr:// sources as layers in neuroglancer; pip install 'blockpred[viewer]' "
                         "prints a link)")
        lines.append("  Ctrl-C stops it")
        print("\n".join(lines), flush=True)

    serve(input, output, config=config, host=host, port=port, cache_mb=cache_mb, cors_origins=tuple(origins),
          on_ready=ready, link=viewer.link, **options)
    return 0
