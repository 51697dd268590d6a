"""OME-NGFF image metadata: writing an image (one scale, or a pyramid), reading its first scale.

blockpred writes the prediction as the array ``0`` inside the image group
(``--pyramid N`` adds ``1`` .. ``N``, see :mod:`blockpred.run.pyramid`):

* zarr format 3 -> OME-NGFF 0.5: ``attributes["ome"] = {"version": "0.5", "multiscales": [...]}``
* zarr format 2 -> OME-NGFF 0.4: top-level ``multiscales`` whose entry carries ``"version": "0.4"``

Axes are ``c`` (type channel) then ``z``, ``y``, ``x`` (type space) for a
(c, z, y, x) array, only ``z``, ``y``, ``x`` for a (z, y, x) one.  The one
``scale`` transformation has 1 for ``c`` and the voxel size for the spatial
axes (1.0 when unknown).  No unit is written: blockpred does not know it.
"""

from __future__ import annotations

from typing import Any

#: The path of the one scale blockpred writes, relative to the image group.
SCALE_PATH = "0"


def axis_names(ndim: int) -> list[str]:
    """``['c', 'z', 'y', 'x']`` for 4 axes, ``['z', 'y', 'x']`` for 3."""
    return ["c", "z", "y", "x"][4 - ndim :]


def image_attributes(ndim: int, voxel_size: tuple[float, ...] | None, zarr_format: int,
                     scales: list[tuple[int, ...]] | None = None, centred: bool = True) -> dict[str, Any]:
    """The group attributes of an OME-NGFF image of ``ndim`` (3 or 4) axes.

    ``scales`` lists, per level (array ``"0"``, ``"1"`` ...), its downsampling
    factor from level 0 (z, y, x); by default the one level 0.  A level's
    ``scale`` is the voxel size times its factor; when ``centred`` (its voxels
    are window means or modes), a ``translation`` of (factor - 1) / 2 voxels of
    level 0 puts each voxel at the centre of the window it stands for.
    """
    spatial = [float(v) for v in (voxel_size or (1.0, 1.0, 1.0))]
    axes = [{"name": name, "type": "channel" if name == "c" else "space"} for name in axis_names(ndim)]
    lead = [1.0] * (ndim - 3)
    datasets = []
    for index, factor in enumerate(scales or [(1, 1, 1)]):
        transformations: list[dict[str, Any]] = [
            {"type": "scale", "scale": lead + [v * f for v, f in zip(spatial, factor)]}]
        if centred and any(f != 1 for f in factor):
            shift = [0.0] * (ndim - 3) + [v * (f - 1) / 2 for v, f in zip(spatial, factor)]
            transformations.append({"type": "translation", "translation": shift})
        path = SCALE_PATH if index == 0 else str(index)
        datasets.append({"path": path, "coordinateTransformations": transformations})
    multiscale: dict[str, Any] = {"axes": axes, "datasets": datasets}
    if zarr_format == 3:
        return {"ome": {"version": "0.5", "multiscales": [multiscale]}}
    return {"multiscales": [{"version": "0.4", **multiscale}]}


def find_multiscales(attributes: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The ``multiscales`` list of a group's attributes (0.5 under ``ome``, 0.4 at the top), or None."""
    ome = attributes.get("ome")
    found = ome.get("multiscales") if isinstance(ome, dict) else attributes.get("multiscales")
    return found if isinstance(found, list) and found else None


def first_scale(multiscales: list[dict[str, Any]]) -> tuple[str, tuple[float, ...] | None]:
    """The path of the first multiscale's first dataset and its (z, y, x) voxel size.

    The voxel size is the dataset's ``scale`` times the multiscale's own
    ``scale`` (when it has one), taken on the axes of type ``space`` (or, when
    the axes have no types, the last three).  None when there is no scale.
    """
    multiscale = multiscales[0]
    dataset = multiscale["datasets"][0]
    scale = _scale_of(dataset.get("coordinateTransformations"))
    if scale is None:
        return dataset["path"], None
    global_scale = _scale_of(multiscale.get("coordinateTransformations"))
    if global_scale is not None and len(global_scale) == len(scale):
        scale = [a * b for a, b in zip(scale, global_scale)]
    axes = multiscale.get("axes") or []
    spatial = [i for i, axis in enumerate(axes) if isinstance(axis, dict) and axis.get("type") == "space"]
    if len(spatial) != 3 or len(axes) != len(scale):
        spatial = list(range(len(scale)))[-3:]
    if len(spatial) != 3:
        return dataset["path"], None
    return dataset["path"], tuple(scale[i] for i in spatial)


def _scale_of(transformations) -> list[float] | None:
    for transformation in transformations or []:
        if transformation.get("type") == "scale" and "scale" in transformation:
            return [float(v) for v in transformation["scale"]]
    return None
