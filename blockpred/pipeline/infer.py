"""The device side: a network on one device, fed raw blocks, returning stored values.

All the arithmetic around the network runs on the device, so only the raw input
goes up (uint8 for EM: a quarter of float32) and only what is stored comes down
(cropped to the block core, the kept channels, in the output dtype)::

    raw blocks -> pinned buffer --upload stream--> raw on device
      -> float32 x * scale + offset -> network -> crop to the core, keep channels
      -> [count NaN/inf per block] -> output dtype --download stream--> pinned buffer -> host

On CUDA, :meth:`Predictor.submit` only enqueues these steps on three streams
and returns a :class:`Pending`; a caller that submits batch n+1 before it
collects batch n gets the upload of n+1, the network on n and the download of
n-1 running at once.  Pinned buffers come from a pool and are reused.  On the
CPU the same steps run the same way on three threads, with the same numbers:
the normalisation in the caller's thread, the network on one thread of the
predictor's, and the steps after it (crop, count, convert) on two others (the
batch before and this one's converted side by side), so a network that leaves
the host's cores free (a stand-in device, a remote accelerator) runs back to
back while the host prepares and converts the batches around it.

NaN and inf.  A conversion to uint8 turns NaN into 0 and inf into 255 (or 0),
so the network's output is checked before it: when the steps name the boxes
each block writes (:attr:`DeviceSteps.counted`), :attr:`Pending.nonfinite`
says how many NaN and inf values each block's box held.  On the CPU the check
is one sum per slab (a sum is finite only when every value is), and values
are counted only in a slab whose sum is not; on CUDA one ``isfinite`` pass and
one sum per block run on the compute stream, and the small count tensor goes
down with the batch, so the check adds no host synchronisation.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from ..choices import BACKENDS, COMPILE_MODES, MEMORY_FORMATS, PRECISIONS
from ..errors import InvalidOptionError
from . import waits
from .backends import make_backend, resolve_device  # noqa: F401 - resolve_device: the pipeline's
from .cpu_steps import after_network, is_normalized, normalized
from .cudnn import kernel_search
from .hostmem import BufferPool, keep_freed_memory, pinned, release_freed_memory

logger = logging.getLogger(__name__)

_AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: Modules whose weights autocast casts to the low precision at every call: cast once instead.
_CAST_ONCE = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d,
              torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d, torch.nn.Linear)
#: Raw dtypes uploaded as they are; uint16 goes up as its int16 bits, anything else as float32.
_UPLOADED = {np.dtype(t) for t in ("uint8", "int8", "int16", "int32", "float16", "float32")}
#: Threads converting the CPU network's outputs: two batches are in flight, so both can convert at once.
AFTER_THREADS = 2
_FLOAT32 = np.dtype(np.float32)
_TORCH_OUTPUT_DTYPES = {np.dtype("float32"): torch.float32, np.dtype("float16"): torch.float16,
                        np.dtype("uint8"): torch.uint8}


@dataclass(frozen=True)
class DeviceSteps:
    """What the device does around the network for one batch.

    ``scale``/``offset`` normalise the raw input (``x * scale + offset`` in
    float32, as :meth:`blockpred.normalize.Normalization.scale_offset` says);
    ``crop`` (spatial slices of the network output) and ``channels`` select
    what is kept; ``output_dtype`` is what comes back: float32, float16, or
    uint8 with [0, 1] mapped to 0-255 (clipped, rounded half to even).
    """

    scale: float = 1.0
    offset: float = 0.0
    crop: tuple[slice, slice, slice] | None = None
    channels: tuple[int, ...] | None = None
    output_dtype: np.dtype = np.dtype("float32")
    #: Per block of the batch, the box of the kept output (after ``crop``) whose NaN and inf values are
    #: counted: what the block writes (at the volume's edge, less than the core).  None counts nothing.
    counted: tuple[tuple[slice, slice, slice], ...] | None = None
    #: Per block of the batch, the volume plane each of its input planes reads (along the stacking axis,
    #: reflected planes as the plane they mirror), for a network with per-plane constants (a 2D bioimage.io
    #: package's per-sample statistics: it is called ``module(x, planes)``).  None: not such a network.
    planes: tuple[tuple[int, ...], ...] | None = None

    def for_core(self, halo: tuple[int, ...], core_shape: tuple[int, ...]) -> "DeviceSteps":
        """These steps, cropping a network output that begins ``halo`` before a core of ``core_shape``."""
        return replace(self, crop=tuple(slice(h, h + n) for h, n in zip(halo, core_shape)))


@dataclass
class Pending:
    """A submitted batch.  :meth:`result` waits for it and gives the host array.

    On CUDA the array is a view of a pinned buffer, handed over without a copy;
    :meth:`release` gives the buffer back for reuse once every use of the
    array is over (a buffer never released is simply freed, never reused).
    """

    _value: np.ndarray | None = None
    #: Seconds of device time: the network and the steps around it (wall time on the CPU).
    compute_s: float = 0.0
    #: Seconds of host <-> device copies (0 on the CPU).
    transfer_s: float = 0.0
    #: Per block, the NaN and inf values in its :attr:`DeviceSteps.counted` box (None when none was named).
    nonfinite: np.ndarray | None = None
    _finish: object = None
    _release: object = None

    def result(self) -> np.ndarray:
        if self._finish is not None:
            self._value, self.compute_s, self.transfer_s, self.nonfinite = self._finish()
            self._finish = None
        return self._value

    def release(self) -> None:
        """The array of :meth:`result` is no longer used: its buffer may be reused."""
        release, self._release, self._value = self._release, None, None
        if release is not None:
            release()


def _upload_form(array: np.ndarray) -> np.ndarray:
    """The array as it goes to the device: its own dtype when torch handles it, else bits or float32."""
    if array.dtype in _UPLOADED:
        return array
    if array.dtype == np.uint16:
        return array.view(np.int16)
    return array.astype(np.float32)


def _check_precision(precision: str) -> None:
    """A predictor runs one of :data:`PRECISIONS`: ``auto`` is chosen before (see :mod:`blockpred.tuning.precision`)."""
    if precision not in PRECISIONS:
        raise InvalidOptionError(f"a predictor's precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def _set_layout(module: torch.nn.Module, memory_format: str) -> None:
    """Every 5D weight in ``channels_last_3d`` (or back), every 4D one in ``channels_last``: a 2D network
    run plane by plane (see :mod:`blockpred.models.planes`) gets its planes channels last."""
    last = memory_format == "channels_last"
    layouts = {5: torch.channels_last_3d if last else torch.contiguous_format,
               4: torch.channels_last if last else torch.contiguous_format}
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if tensor.dim() in layouts:
                tensor.data = tensor.data.contiguous(memory_format=layouts[tensor.dim()])


class Predictor:
    """Runs ``module`` on ``device`` at ``precision`` (fp32, tf32, fp16, bf16).

    fp16 and bf16 run under autocast with the weights of convolutions and
    linear layers cast once, here, rather than at every call.  ``compile``
    (a :data:`COMPILE_MODES` name; ``reduce-overhead`` replays CUDA graphs)
    and ``memory_format`` (``channels_last`` for ``channels_last_3d``) are
    the optional fast paths; ``search``: cuDNN's kernel search at new shapes (:mod:`blockpred.tuning.search`).
    ``backend`` (``torch`` or, on the CPU, ``openvino``: see :mod:`.backends`)
    runs the network; ``backend_key`` names it in the conversion cache.
    """

    def __init__(self, module: torch.nn.Module, device: torch.device, precision: str = "fp32", *,
                 compile: str = "off", memory_format: str = "contiguous", backend: str = "torch",
                 backend_key: dict | None = None):
        if compile not in COMPILE_MODES:
            raise InvalidOptionError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {compile!r}")
        if memory_format not in MEMORY_FORMATS:
            raise InvalidOptionError(f"memory format must be one of {', '.join(MEMORY_FORMATS)}, got {memory_format!r}")
        _check_precision(precision)
        if backend not in BACKENDS:
            raise InvalidOptionError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if backend != "torch" and (device.type != "cpu" or compile != "off"):
            raise InvalidOptionError(f"--backend {backend} runs on the CPU, uncompiled; on {device} use --backend "
                                     f"torch (or auto){' and drop --compile' if compile != 'off' else ''}")
        self.backend, self._backend_key = backend, backend_key
        keep_freed_memory()  # a block's activations are reused from pass to pass, not faulted in anew
        self.device = device
        self.compile = compile
        self.memory_format = memory_format
        self._given = module
        #: A torch dispatch mode the network's passes run under, in whichever thread runs them (None: none).
        self.watch = None
        self._build(precision)
        self._cuda = device.type == "cuda"
        #: On the CPU, the network's thread and the thread of the steps after it (made at the first batch).
        self._threads: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        #: On the CPU, the normalised inputs and converted outputs, reused (two batch shapes: a trial's, the run's).
        self._arrays = BufferPool(np.empty, max_keys=4)
        self.search = False
        if self._cuda:
            self._upload = torch.cuda.Stream(device)
            self._compute = torch.cuda.Stream(device)
            self._download = torch.cuda.Stream(device)
            self._compute.wait_stream(torch.cuda.current_stream(device))  # the weights' copies
            self._pool = BufferPool(pinned)

    def _build(self, precision: str) -> None:
        """The predictor's own copy of the network given, on the device, at ``precision``: casting weights, changing
        the layout and moving to the device must not reach the caller's module (the API's predict(model=net), several
        predictors on one model).  Copied without autograd: a deep copy of a TorchScript module otherwise holds
        parameters that are not leaves and require grad (every output then carries a graph; .to() warns)."""
        with torch.no_grad():
            module = copy.deepcopy(self._given).to(self.device).eval()
        low = _AUTOCAST_DTYPES.get(precision) if self.backend == "torch" else None  # another backend casts itself
        if low is not None:
            for layer in module.modules():
                if isinstance(layer, _CAST_ONCE):
                    layer.to(low)
        if self.memory_format == "channels_last":
            _set_layout(module, self.memory_format)
        self.precision, self.module = precision, module
        self._forward = make_backend(self.backend, module, precision=precision, key=self._backend_key)
        if self.compile != "off":
            self._forward = torch.compile(module, mode=None if self.compile == "default" else self.compile,
                                          dynamic=False)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"

    def use_precision(self, precision: str) -> None:
        """Run at ``precision`` from now on: the network given is copied and cast again (a fallback of
        ``--precision auto``, see :mod:`blockpred.tuning.precision`)."""
        _check_precision(precision)
        if precision != self.precision:
            self._build(precision)
            if self._cuda:
                self._compute.wait_stream(torch.cuda.current_stream(self.device))  # the weights' copies

    def use_backend(self, backend: str) -> None:
        """Run the network on ``backend`` from now on (the measured choice of ``--backend auto``)."""
        if backend != self.backend:
            if backend not in BACKENDS:
                raise InvalidOptionError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
            self.backend = backend
            if backend != "torch":
                self.memory_format = "contiguous"  # OpenVINO lays out its own tensors
            self._build(self.precision)

    @property
    def converted(self):
        """The network another backend runs (a :class:`~.converted.ConvertedNetwork`); None on torch."""
        return self._forward if self.backend != "torch" else None

    @property
    def backend_note(self) -> str:
        """What ran the network: ``torch``, ``openvino`` or ``torch (openvino: <why not>)``."""
        converted = getattr(self.converted, "converted", None)
        return self.backend if converted in (None, True) else f"torch ({self.backend}: {self._forward.reason})"

    def use_memory_format(self, memory_format: str) -> None:
        """Switch the weights and the activations to ``memory_format`` (not with ``compile``: it would recompile)."""
        if memory_format not in MEMORY_FORMATS:
            raise InvalidOptionError(f"memory format must be one of {', '.join(MEMORY_FORMATS)}, got {memory_format!r}")
        if self.compile != "off" and memory_format != self.memory_format:
            raise InvalidOptionError("the memory format of a compiled network is fixed; choose it with --memory-format")
        _set_layout(self.module, memory_format)
        self.memory_format = memory_format

    def autocast(self):
        """The autocast context of this precision (a no-op for fp32 and tf32)."""
        dtype = _AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def submit(self, blocks: Sequence[np.ndarray], steps: DeviceSteps = DeviceSteps()) -> Pending:
        """Start the batch of ``blocks`` (each (C, Z, Y, X), raw dtype, all one shape).

        Errors of the network (out of memory included) are raised here or by
        :meth:`Pending.result` (on the CPU the network runs on its own thread).
        """
        if not self._cuda:
            return self._submit_cpu(blocks, steps)
        return self._submit_cuda(blocks, steps)

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        """The network's float32 output for a (B, C, Z, Y, X) batch, unnormalised and uncropped."""
        return self.submit(list(batch)).result()

    def output_shape(self, input_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Dry run on zeros of ``input_shape`` (B, C, Z, Y, X): the output's shape."""
        return tuple(self(np.zeros(input_shape, dtype=np.float32)).shape)

    def forward(self, x: torch.Tensor, planes: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """The network on a normalised float32 batch already on the device, in this predictor's fast path.

        ``planes`` (see :attr:`DeviceSteps.planes`) go to the network as a (b, depth) int64 tensor."""
        if self.memory_format == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last_3d)
        if self.compile == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.inference_mode(), self.autocast(), kernel_search(self.search), \
                self.watch or contextlib.nullcontext():
            if planes is None:
                return _as_tensor(self._forward(x))
            return _as_tensor(self._forward(x, torch.as_tensor(np.asarray(planes, dtype=np.int64), device=x.device)))

    def _steps(self, raw: torch.Tensor, raw_dtype: np.dtype,
               steps: DeviceSteps) -> tuple[torch.Tensor, torch.Tensor | None]:
        """On CUDA: normalise, run the network, crop, count NaN/inf and convert, out of place, on the device.

        Returns the converted values and, when ``steps.counted`` names boxes, the
        int64 NaN/inf count per block (on the device).
        """
        with torch.inference_mode():
            x = raw
            if raw_dtype == np.uint16:  # uploaded as its int16 bits
                x = x.to(torch.int32).bitwise_and_(0xFFFF)
            if x.dtype != torch.float32 or steps.scale != 1.0 or steps.offset != 0.0:
                x = x.to(torch.float32)
                if steps.scale != 1.0:
                    x.mul_(steps.scale)
                if steps.offset != 0.0:
                    x.add_(steps.offset)
            y = self.forward(x, steps.planes)
            channels = range(y.shape[1]) if steps.channels is None else steps.channels
            if steps.crop is not None:
                y = y[(slice(None), slice(None)) + tuple(steps.crop)]
            counts = None
            if steps.counted is not None:
                counts = torch.zeros(y.shape[0], dtype=torch.int64, device=y.device)
                _count_nonfinite(y if steps.channels is None else y[:, list(channels)],
                                 _explicit(steps.counted, y.shape[2:]), counts)
            if steps.channels is None and steps.crop is None and y.dtype == torch.float32 \
                    and steps.output_dtype == np.float32:
                # Nothing to convert: the network's own output (a copy if CUDA graphs will reuse its buffer).
                return (y.clone() if self.compile == "reduce-overhead" else y), counts
            source = y if steps.channels is None else y[:, list(channels)]
            if steps.output_dtype == np.uint8:
                source = torch.clamp(source.float(), 0.0, 1.0).mul_(255.0).round_()
            result = torch.empty(source.shape, device=y.device, dtype=_TORCH_OUTPUT_DTYPES[np.dtype(steps.output_dtype)])
            result.copy_(source)
            return result, counts

    def _submit_cpu(self, blocks: Sequence[np.ndarray], steps: DeviceSteps) -> Pending:
        """Normalise here, then the network on a thread of its own and the steps after it on one of two others.

        The steps are numpy's (see :mod:`.cpu_steps`); the network gets a
        tensor over the normalised array, without a copy.  The normalised
        array goes back to the pool once the steps after the network are done
        with it, and the converted one when :meth:`Pending.release` says so.
        """
        start = time.perf_counter()
        arrays = self._arrays
        if len(blocks) == 1:
            raw, stacked = blocks[0][np.newaxis], None  # one block: no copy
        else:
            raw = stacked = np.stack(blocks, out=arrays.take((len(blocks),) + blocks[0].shape, blocks[0].dtype))
        owned = None
        if not is_normalized(raw.dtype, steps.scale, steps.offset):
            owned = normalized(raw, steps.scale, steps.offset, out=arrays.take(raw.shape, _FLOAT32))
            if stacked is not None:
                arrays.give(stacked)
                stacked = None
        x = torch.from_numpy(raw if owned is None else owned)
        before_s = time.perf_counter() - start
        if self._threads is None:
            self._threads = (ThreadPoolExecutor(1, thread_name_prefix="blockpred-network"),
                             ThreadPoolExecutor(AFTER_THREADS, thread_name_prefix="blockpred-after"))
        network = self._threads[0].submit(_timed, self.forward, x, steps.planes)
        del x  # the network's thread holds the input only as long as the network runs
        after = self._threads[1].submit(self._after_network, network, steps, owned if stacked is None else stacked)

        def finish() -> tuple[np.ndarray, float, float, np.ndarray | None]:
            values, counts, seconds, _ = waits.result(after)  # in the main thread: see .waits
            return values, before_s + seconds, 0.0, counts

        def release() -> None:
            if after.exception() is None:
                values, _, _, pooled = after.result()
                if pooled:
                    arrays.give(values)

        return Pending(_finish=finish, _release=release)

    def _after_network(self, network: Future, steps: DeviceSteps, owned: np.ndarray | None
                       ) -> tuple[np.ndarray, np.ndarray | None, float, bool]:
        """The steps after the network; ``owned``, the pool's input array, goes back unless the values use it.

        Returns the values, the NaN/inf counts, the seconds of the network and
        these steps, and whether the values are the pool's (a new array, not the
        network's own output).
        """
        try:
            out, network_s = network.result()  # the network's error, if any, is the batch's
        except BaseException:
            if owned is not None:
                self._arrays.give(owned)
            raise
        start = time.perf_counter()
        with torch.inference_mode():
            values = (out if out.dtype == torch.float32 else out.float()).numpy()
        del out
        crop = None if steps.crop is None else tuple(steps.crop)
        cropped = values.shape[2:] if crop is None else values[(0, 0) + crop].shape
        counted = None if steps.counted is None else _explicit(steps.counted, cropped)
        result, counts = after_network(values, crop=crop, channels=steps.channels, output_dtype=steps.output_dtype,
                                       counted=counted, empty=self._arrays.take)
        pooled = not np.may_share_memory(result, values)
        if owned is not None and not np.may_share_memory(result, owned):
            self._arrays.give(owned)  # a network that returns (a view of) its input leaves it in the values
        return result, counts, network_s + time.perf_counter() - start, pooled

    def _submit_cuda(self, blocks: Sequence[np.ndarray], steps: DeviceSteps) -> Pending:
        first = _upload_form(blocks[0])
        host_in = self._pool.take((len(blocks),) + first.shape, torch.from_numpy(first[:0]).dtype)
        np.stack([_upload_form(b) for b in blocks], out=host_in.numpy())
        events = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
        with torch.cuda.stream(self._upload):
            events[0].record()
            on_device = host_in.to(self.device, non_blocking=True)
            events[1].record()
        self._compute.wait_event(events[1])
        with torch.cuda.stream(self._compute):
            on_device.record_stream(self._compute)  # made on the upload stream, used on this one
            events[2].record()
            result, counts = self._steps(on_device, blocks[0].dtype, steps)
            events[3].record()
        self._download.wait_event(events[3])
        host_out = self._pool.take(tuple(result.shape), result.dtype)
        host_counts = None if counts is None else self._pool.take(tuple(counts.shape), counts.dtype)
        with torch.cuda.stream(self._download):
            result.record_stream(self._download)
            events[4].record()
            host_out.copy_(result, non_blocking=True)
            if counts is not None:  # a few bytes, down with the batch: no synchronisation of its own
                counts.record_stream(self._download)
                host_counts.copy_(counts, non_blocking=True)
            events[5].record()

        def finish() -> tuple[np.ndarray, float, float, np.ndarray | None]:
            events[5].synchronize()
            self._pool.give(host_in)
            nonfinite = None
            if host_counts is not None:
                nonfinite = host_counts.numpy().copy()
                self._pool.give(host_counts)
            transfer_ms = events[0].elapsed_time(events[1]) + events[4].elapsed_time(events[5])
            return host_out.numpy(), events[2].elapsed_time(events[3]) / 1e3, transfer_ms / 1e3, nonfinite

        return Pending(_finish=finish, _release=lambda: self._pool.give(host_out))

    def release_memory(self, host: bool = False) -> None:
        """Give cached device memory back (after an out-of-memory error, or trial runs).

        ``host`` (after trials, with no batch in flight), on the CPU: the pooled arrays of the trials' shapes, the
        buffers a backend keeps for the largest shape it ran (its ``release_memory``: OpenVINO's), and the heap's
        free pages (:func:`.hostmem.release_freed_memory`), so a run at a smaller block does not hold the trials'.
        """
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        elif host:
            self._arrays.clear()
            release = getattr(self._forward, "release_memory", None) if self.backend != "torch" else None
            if release is not None:
                release()
            release_freed_memory()


def _count_nonfinite(values: torch.Tensor, boxes: Sequence[tuple[slice, ...]], counts: torch.Tensor) -> None:
    """Add to ``counts[i]`` the NaN and inf values of block ``i`` of ``values`` (B, C, Z, Y, X) inside ``boxes[i]``.

    One ``isfinite`` pass; one sum over the batch when every box is the whole
    block, else one per block.  Only device operations: nothing waits for them.
    """
    finite = torch.isfinite(values)
    whole = tuple(slice(0, n) for n in values.shape[2:])
    if all(box == whole for box in boxes):
        counts += finite[0].numel() - finite.sum(dim=(1, 2, 3, 4))
        return
    for i, box in enumerate(boxes):
        region = finite[(i, slice(None)) + box]
        counts[i] += region.numel() - region.sum()


def _explicit(boxes: Sequence[tuple[slice, ...]], shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """``boxes`` (slices that may be open, in a frame of ``shape``) with explicit begin and end."""
    return [tuple(slice(*s.indices(n)[:2]) for s, n in zip(box, shape)) for box in boxes]


def _timed(function, *args):
    """``function(*args)`` and the seconds it took."""
    start = time.perf_counter()
    return function(*args), time.perf_counter() - start


def _as_tensor(result) -> torch.Tensor:
    """Networks that return a tuple or list give their first output."""
    if isinstance(result, (tuple, list)):
        result = result[0]
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"the network returned {type(result).__name__}, expected a tensor")
    return result
