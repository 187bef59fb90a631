"""The tensor-bytes meter (finetune/training/tensor_bytes.py) on a program whose bytes are known: tensors of given sizes
made, freed, turned into a gradient and into optimizer state in this process. The expected figures are sizes times 4
(float32), not the meter's own sums: the real runs of tests/training/test_tensor_bytes.py cannot check the meter
against anything but the planner."""

from __future__ import annotations

import warnings

import torch

from finetune.training.tensor_bytes import LiveBytes


def test_the_meter_counts_a_known_program_by_category():
    param = torch.nn.Parameter(torch.ones(1000))  # held before the meter starts: never counted
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9, foreach=False)  # its state: one buffer like the grad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own, from the meter's scan of live objects
        with LiveBytes() as mode:
            kept = torch.ones(1000)  # 4,000 bytes
            gone = torch.ones(3000)  # 12,000 bytes, freed at once: the peak so far, 16,000, all activations
            del gone
            assert (mode.live, mode.peak, mode.peak_parts) == (4000, 16000, {"activations": 16000})
            loss = (param * kept).sum()  # the product is freed inside the expression; the loss is 4 bytes
            loss.backward()  # param.grad: 4,000 bytes, a gradient once accumulated
            optimizer.step()  # the momentum buffer: 4,000 bytes of optimizer state
            assert mode.live == 4000 + 4 + 4000 + 4000 and mode.peak == 16000
            big = torch.ones(5000)  # 20,000 bytes: a new peak, 32,004, split by what is alive at that moment
            assert mode.peak == 32004
            assert mode.peak_parts == {"activations": 24004, "gradients": 4000, "optimizer": 4000}
            del big, kept, loss
            param.grad = None
            optimizer.state.clear()
            assert mode.live == 0 and mode.peak == 32004
