"""A CUDA device simulated on the CPU, for tests of what a loader places on the training device and of how many bytes
it copies there (these machines have no GPU). Not a test module itself.

How it is simulated: every torch call inside `with SimulatedGpu() as gpu:` goes through a TorchFunctionMode, which
  * runs a factory asked for `device="cuda..."` (torch.zeros, torch.tensor, ...) on the CPU and records its result
    as held by the GPU;
  * runs a move to CUDA (`.to("cuda:0")`, `.to(gpu_tensor)`, `.cuda()`) as a CPU copy (a copy, as a real host-to-device
    move makes one) and records it, counting its bytes as host-to-device traffic; a move of a GPU tensor to the CPU
    (`.cpu()`, `.to("cpu")`) is a copy that is not recorded;
  * counts the bytes of a CPU tensor copied into a GPU tensor (`gpu_tensor.copy_(cpu)`, `gpu_tensor[i] = cpu`);
  * records every tensor computed from a GPU tensor (views, casts, bitsandbytes' quantization): a GPU op's result is
    on the GPU.
A tensor is held by the GPU when its storage was recorded (so a Parameter made of a GPU tensor is too). The recorded
storages are kept alive until the block ends, so no later CPU tensor can reuse their addresses. What the mode cannot
fake is `tensor.device`, which stays `cpu`: code that picks a device from a tensor's `.device` sees the CPU (the
loaders pick it from their `device` argument).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

CUDA = torch.device("cuda", 0)
_FROM_HOST_DATA = {torch.tensor, torch.as_tensor}  # factories whose data comes from the host


class SimulatedGpu(TorchFunctionMode):
    """One simulated GPU (`cuda:0`): which tensors it holds (`holds`) and the bytes copied to it from the host."""

    def __init__(self) -> None:
        super().__init__()
        self.host_to_device_bytes = 0
        self._storages: dict[int, torch.UntypedStorage] = {}  # data_ptr -> the storage, held alive
        self._empty: dict[int, torch.Tensor] = {}  # id -> tensor, for tensors without bytes (no address to record)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is on the simulated GPU."""
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
            return False
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return id(tensor) in self._empty
        return storage.data_ptr() in self._storages

    def _record(self, result):
        for tensor in tree_flatten(result)[0]:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                storage = tensor.untyped_storage()
                if storage.nbytes() == 0:
                    self._empty[id(tensor)] = tensor
                else:
                    self._storages.setdefault(storage.data_ptr(), storage)
        return result

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return self._move(func, args, kwargs)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
            result = func(*args, **kwargs)
            if func in _FROM_HOST_DATA:
                self.host_to_device_bytes += result.numel() * result.element_size()
            return self._record(result)
        if func in (torch.Tensor.copy_, torch.Tensor.__setitem__) and self.holds(args[0]):
            source = args[-1]
            if isinstance(source, torch.Tensor) and not self.holds(source):
                self.host_to_device_bytes += source.numel() * args[0].element_size()
            return func(*args, **kwargs)
        result = func(*args, **kwargs)
        if any(self.holds(t) for t in tree_flatten((args, kwargs))[0]):
            self._record(result)
        return result

    def _move(self, func, args, kwargs):
        tensor, rest = args[0], args[1:]
        kwargs.pop("copy", None)  # a move here always copies (or stays put)
        if func is torch.Tensor.cpu:
            target, dtype = torch.device("cpu"), None
        elif func is torch.Tensor.cuda:
            target, dtype = CUDA, None
        elif rest and isinstance(rest[0], torch.Tensor):  # .to(other): other's device and dtype
            target, dtype = (CUDA if self.holds(rest[0]) else rest[0].device), rest[0].dtype
        else:
            target, dtype, _, _ = torch._C._nn._parse_to(*rest, **kwargs)
            target = CUDA if _is_cuda(target) else target
        dtype = dtype or tensor.dtype
        on_gpu = self.holds(tensor)
        if target is None or (target == CUDA and on_gpu):  # stays where it is (a cast at most)
            result = torch.Tensor.to(tensor, dtype=dtype)
            return self._record(result) if on_gpu else result
        if target == CUDA:  # host to device
            result = torch.Tensor.to(tensor, "cpu", dtype, copy=True)
            self.host_to_device_bytes += result.numel() * result.element_size()
            return self._record(result)
        if on_gpu and target.type == "cpu":  # device to host: a copy the GPU does not hold
            return torch.Tensor.to(tensor, "cpu", dtype, copy=True)
        return func(*args, **kwargs)


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"

