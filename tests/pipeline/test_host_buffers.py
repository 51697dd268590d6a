"""On the CPU the device's arrays are reused from batch to batch, and never while anything still uses them."""

import numpy as np
import torch

from blockpred.normalize import convert_output
from blockpred.pipeline import DeviceSteps, Predictor

SCALE = 1 / 255


class Identity(torch.nn.Module):
    def forward(self, x):
        return x


class Triple(torch.nn.Module):
    """Its input repeated to 3 channels, a view: the network's output is its input's memory."""

    def forward(self, x):
        return x.expand(-1, 3, -1, -1, -1)


def raw_blocks(count, shape=(1, 20, 30, 40)):
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(count)]


def expected_uint8(block, crop):
    values = np.repeat(block.astype(np.float32) * np.float32(SCALE), 3, axis=0)
    return convert_output(values[(slice(None),) + crop], np.dtype("uint8"))


def test_a_released_output_is_the_next_batchs_and_each_batch_gets_its_own_values():
    crop = (slice(2, 18), slice(3, 27), slice(4, 36))
    steps = DeviceSteps(scale=SCALE, crop=crop, output_dtype=np.dtype("uint8"))
    predictor = Predictor(Triple(), torch.device("cpu"))
    first, second = raw_blocks(2)

    pending = predictor.submit([first], steps)
    values = pending.result()
    np.testing.assert_array_equal(values[0], expected_uint8(first, crop))
    pending.release()  # written: its array may carry the next batch
    again = predictor.submit([second], steps)
    assert again.result() is values
    np.testing.assert_array_equal(again.result()[0], expected_uint8(second, crop))


def test_an_output_not_released_is_never_reused():
    crop = (slice(0, 20), slice(0, 30), slice(0, 40))
    steps = DeviceSteps(scale=SCALE, crop=crop, output_dtype=np.dtype("uint8"))
    predictor = Predictor(Triple(), torch.device("cpu"))
    blocks = raw_blocks(3)

    held = [predictor.submit([block], steps).result() for block in blocks]

    for values, block in zip(held, blocks):
        np.testing.assert_array_equal(values[0], expected_uint8(block, crop))
    assert not any(np.shares_memory(a, b) for i, a in enumerate(held) for b in held[i + 1:])


def test_an_output_that_is_the_networks_normalised_input_is_not_handed_to_the_next_batch():
    # float32 out, nothing cropped: the values are the network's output, here its (normalised) input itself.
    steps = DeviceSteps(scale=SCALE)
    predictor = Predictor(Identity(), torch.device("cpu"))
    blocks = raw_blocks(3)

    first = predictor.submit([blocks[0]], steps)
    kept = first.result()
    second = predictor.submit([blocks[1]], steps).result()
    first.release()
    third = predictor.submit([blocks[2]], steps).result()

    for values, block in zip((kept, second, third), blocks):
        np.testing.assert_array_equal(values[0], block.astype(np.float32) * np.float32(SCALE))
    assert not np.shares_memory(kept, second) and not np.shares_memory(second, third)
