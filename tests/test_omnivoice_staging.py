"""The worker's host-to-device staging (gpu_worker/omnivoice/staging.py): the packed copy's views."""

import numpy as np
import pytest
import torch

from gpu_worker.omnivoice.staging import to_device_together

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_together_keeps_each_arrays_dtype_shape_and_values(device):
    rng = np.random.default_rng(0)
    arrays = [np.arange(5, dtype=np.int64), np.zeros(0, np.int64), rng.random((3, 7)).astype(np.float32),
              np.array([True, False, True]), rng.random(3), np.arange(6, dtype=np.int64)[::2]]
    for a, t in zip(arrays, to_device_together(arrays, torch.device(device))):
        assert t.device.type == device
        assert t.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype and tuple(t.shape) == a.shape
        np.testing.assert_array_equal(t.cpu().numpy(), a)
