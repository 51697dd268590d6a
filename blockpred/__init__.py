"""blockpred: run a 3D network block by block over volumes larger than memory.

>>> import blockpred
>>> summary = blockpred.predict("volume.zarr/raw", "volume.zarr/prediction", model="tiny", block=64)
>>> prediction = blockpred.predict(array, model="tiny")  # a numpy, dask or zarr array in, a numpy array out
"""

__version__ = "0.1.0"

__all__ = ["predict", "plan", "PredictionSummary", "RunPlan", "__version__"]


def __getattr__(name):
    # Imported on first use, so `blockpred --help` does not wait for torch.
    if name in ("predict", "plan", "PredictionSummary"):
        from .run import runner

        return getattr(runner, name)
    if name == "RunPlan":
        from .run.plan import RunPlan

        return RunPlan
    raise AttributeError(f"module 'blockpred' has no attribute {name!r}")
