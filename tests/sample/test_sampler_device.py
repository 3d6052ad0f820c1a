"""The device-agnostic sampler gives, on CPU, exactly what the CPU-only sampler gave for a
scenario using every feature (recorded in sampler_golden.json)."""

from __future__ import annotations

import pytest
import torch
from sampler_scenario import assert_same, load_golden, make_requests, run

from tokenmill.sample.sampler import Sampler, SamplingBatch, _top_k_top_p


@pytest.mark.parametrize("device", [None, "cpu"])
def test_cpu_results_unchanged(device):
    assert_same(run(device), load_golden())


def test_batch_tensors_on_the_requested_device():
    """Every tensor of a batch using every feature sits on the device asked for ("meta" here:
    a tensor built without device= would be on the CPU)."""
    reqs = make_requests()
    for r in reqs:
        r.generator = None  # meta has no generators; the seeded path is covered on CUDA
    batch = SamplingBatch.from_requests(reqs, 100, device="meta")
    tensors = [v for v in vars(batch).values() if isinstance(v, torch.Tensor)]
    tensors += [t for v in vars(batch).values() if isinstance(v, tuple) for t in v]
    assert len(tensors) == 14
    assert all(t.device.type == "meta" for t in tensors)
    # Penalties, bias, watermark, bans and the grammar (with its fallback row) on meta logits:
    # an op mixing in a CPU tensor fails there as it would on CUDA.
    logits = Sampler().process_logits(torch.zeros(10, 100, device="meta"), batch)
    assert logits.device.type == "meta"
    assert _top_k_top_p(logits, batch.top_k, batch.top_p).device.type == "meta"


def test_batch_device_mismatch_is_an_error():
    batch = SamplingBatch.from_requests(make_requests([0]), 100, device="meta")
    with pytest.raises(ValueError, match="device=logits.device"):
        Sampler()(torch.zeros(1, 100), batch)
