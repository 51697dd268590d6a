"""``blockpred bench``: model throughput on the device (:mod:`.benchmark`), Mvox/s and runtime extrapolation
(:mod:`.metrics`) and the device's load while it runs (:mod:`.monitor`).  It sits on top: it may import the run
(it times what ``blockpred run`` would choose) and everything below; only the CLI imports it.
"""
