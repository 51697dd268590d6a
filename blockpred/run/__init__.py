"""Planning and executing one run: what ``blockpred run`` and ``blockpred plan`` do between the config and the
workers.

It owns the run's checks (:mod:`.prepare`: every check, nothing written), its choices (:mod:`.choose`: block,
halo, batch and memory format; :mod:`.halo`: the receptive-field halo; :mod:`.layout`: output chunks and
shards), its output (:mod:`.output`, :mod:`.pyramid`, :mod:`.downsample`), its plan (:mod:`.plan`), a package's
statistics pass (:mod:`.package_stats`) and the API's :func:`~.runner.predict` and :func:`~.runner.plan`.  It
may import the measured defaults (:mod:`blockpred.tuning`), dask (:mod:`blockpred.cluster`) and everything below
them; nothing below imports it.
"""
