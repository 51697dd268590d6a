"""The names an option takes: one place for every layer (the config checks them, the modules that act on them
take them from here), so that no layer imports a higher one for a tuple of words.  No dependencies."""

#: Precisions a network runs at.
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
#: A run's precisions: ``auto`` chooses one of :data:`PRECISIONS` per device (see :mod:`blockpred.tuning.precision`).
RUN_PRECISIONS = ("auto",) + PRECISIONS
#: ``torch.compile`` modes (``off``: not compiled).
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
#: What runs the network (``openvino``, ``onnxruntime``: on the CPU); a run's ``auto`` chooses between torch and
#: openvino by measuring.
BACKENDS = ("torch", "openvino", "onnxruntime")
RUN_BACKENDS = ("auto",) + BACKENDS
#: Activation layouts (``channels_last`` is ``channels_last_3d``).
MEMORY_FORMATS = ("contiguous", "channels_last")
#: How a block is padded past the volume's edge.
PAD_MODES = ("reflect", "edge", "constant")
#: ``--shards`` words (or a shape).
SHARD_CHOICES = ("auto", "off", "block")
#: How each pyramid level is made from the one before.
PYRAMID_METHODS = ("mean", "mode", "stride")
#: The batch systems ``--cluster`` takes.
BATCH_SYSTEMS = ("slurm",)
#: What a missing input chunk does.
MISSING_CHUNKS = ("warn", "error")

#: The run's options that take one of a few words (in any case), and those words.
OPTION_CHOICES = {"compile": COMPILE_MODES, "precision": RUN_PRECISIONS, "backend": RUN_BACKENDS, "pad_mode": PAD_MODES,
                  "memory_format": MEMORY_FORMATS + ("auto",), "pyramid_method": PYRAMID_METHODS,
                  "missing_chunks": MISSING_CHUNKS, "cluster": BATCH_SYSTEMS}
