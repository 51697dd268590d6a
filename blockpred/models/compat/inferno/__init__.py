"""blockpred's stand-in for inferno (inferno-pytorch), importable as ``inferno`` where inferno is not installed.

See :mod:`blockpred.models.compat`: the building blocks of published inferno models, nothing else."""

__version__ = "0.1.7+blockpred.compat"
