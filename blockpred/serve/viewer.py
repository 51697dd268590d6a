"""neuroglancer for ``blockpred serve``: a link to paste, or (``--viewer``) a viewer of its own.

Both come from the ``neuroglancer`` package (``pip install 'blockpred[viewer]'``):
its :class:`neuroglancer.ViewerState` makes the state and :func:`neuroglancer.to_url`
the link, so no state is written here by hand.  Without the package the server
prints the two ``zarr://`` sources to add in any neuroglancer.
"""

from __future__ import annotations

from ..errors import InvalidOptionError

#: The client a pasted link opens in.
PUBLIC_CLIENT = "https://neuroglancer-demo.appspot.com"


def available() -> bool:
    try:
        import neuroglancer  # noqa: F401
    except ImportError:
        return False
    return True


def _layers(state, served) -> None:
    import neuroglancer

    state.layers["raw"] = neuroglancer.ImageLayer(source=f"zarr://{served.raw_url}")
    state.layers["prediction"] = neuroglancer.ImageLayer(source=f"zarr://{served.prediction_url}")


def link(served) -> str | None:
    """A link that opens neuroglancer's public client on the raw input and the prediction; None without the
    package."""
    if not available():
        return None
    import neuroglancer

    state = neuroglancer.ViewerState()
    _layers(state, served)
    return neuroglancer.to_url(state, prefix=PUBLIC_CLIENT)


def start_viewer(host: str = "127.0.0.1"):
    """A neuroglancer viewer served by this process (its own port on ``host``), with no layers yet."""
    if not available():
        raise InvalidOptionError("--viewer needs neuroglancer: pip install 'blockpred[viewer]' (or drop --viewer "
                                 "and paste the printed sources into any neuroglancer)")
    import neuroglancer

    neuroglancer.set_server_bind_address(host)
    return neuroglancer.Viewer()


def show(viewer, served) -> str:
    """``viewer`` on the raw input and the prediction; its URL."""
    with viewer.txn() as state:
        _layers(state, served)
    return viewer.get_viewer_url()


def origin(url: str) -> str:
    """``scheme://host:port`` of ``url`` (the viewer's, for the server's CORS)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"
