"""The measured defaults: what a run does not name is found by short trials on the device, cached.

The trial search of sizes (:mod:`.autosize`, :mod:`.sizing`, :mod:`.sizecache`) and the budget it may spend
(:mod:`.defaults`), the memory format (:mod:`.memformat`), ``--precision auto``'s check (:mod:`.precision`) and
the network's dry run at a block (:mod:`.network`).  It may import the config, the pipeline (its trials are the
pipeline's device path), the models and the core; the run imports it, nothing below does.
"""
