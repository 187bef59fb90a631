"""Counting what would be a host sync on a GPU, on a machine that has none (test helper).

On CUDA the host waits for the device whenever it needs a value the device computed: `.item()`, `int()`, `float()` or
`bool()` of a tensor, `.tolist()`, and every op whose output shape depends on the values (`nonzero`, one-argument
`torch.where`, boolean-mask indexing, `masked_select`, `unique`, `bincount`: its CUDA kernel reads max() to size its
output). A CPU shows no such stall, so `HostSyncs` counts those ops instead. It is a TorchDispatchMode, so it sees the
aten op under every Python spelling (`x[mask]` arrives as `aten.index` with a bool index, `int(t)` as
`_local_scalar_dense`); `.tolist()` of a CPU tensor reads memory without any op, so it is patched while the mode is on.

On a GPU machine the batch comes from the data loader in host memory, and work on it is no sync; only what
`.to(device)` returns lives on the device. On a CPU both are the same memory, so the tensors named `host=` (the
loader's batch) and everything computed from them alone count as host tensors, and `Tensor.to` with a device, patched,
returns a fresh tensor that counts as a device tensor, as the real transfer would. Everything else (model weights,
activations, factory calls) is on the device: a factory call without a device, host memory on a GPU machine, counts
as a device tensor too, so the count is an upper bound. Device-to-host copies (`.cpu()`) are not seen: on a CPU they
are no op, and nor are syncs inside a CUDA kernel's own C++ (they do not exist on a CPU).
"""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
# Ops whose result the host must wait for (a value, or an output size read from the values).
_SYNC_OPS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.bincount, aten._unique2, aten.unique_dim,
             aten.unique_consecutive, aten.histc}
# Indexing ops that turn a bool/uint8 index into positions with a nonzero inside their kernel (not seen as an op).
_MASK_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _caller() -> str:
    """The innermost frame outside torch and this file, e.g. `finetune/model/experts/routed.py:95`: the code that asked for
    the value (ours, or a library's such as transformers' mask preparation), for the assertions and their messages."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and not path.endswith("/host_syncs.py"):
            short = path.split("site-packages/")[-1] if "site-packages/" in path else "/".join(path.split("/")[-3:])
            return f"{short}:{frame.lineno}"
    return "?"


class HostSyncs(TorchDispatchMode):
    """`with HostSyncs(host=batch.values()) as syncs: ...` then `syncs.count`, and `syncs.where`: each op and the code
    that asked for it (`_caller`)."""

    def __init__(self, *, host=()):
        super().__init__()
        self.host = WeakIdKeyDictionary()
        for tensor in host:
            self.host[tensor] = True
        self.where: list[str] = []
        self._patched: list[tuple[str, object]] = []

    @property
    def count(self) -> int:
        return len(self.where)

    def ours(self) -> list[str]:
        """The syncs asked for by finetune's own code (not by a library it calls, e.g. transformers' masks)."""
        return [where for where in self.where if where.rsplit(" at ", 1)[-1].startswith("finetune/")]

    def _record(self, what: str) -> None:
        self.where.append(f"{what} at {_caller()}")

    def _on_host(self, tensors: list[torch.Tensor]) -> bool:
        return bool(tensors) and all(tensor in self.host for tensor in tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        on_host = self._on_host(tensors)
        masked = func.overloadpacket in _MASK_INDEX_OPS and len(args) > 1 and any(
            leaf.dtype in (torch.bool, torch.uint8) for leaf in tree_leaves(args[1]) if isinstance(leaf, torch.Tensor))
        if not on_host and (func.overloadpacket in _SYNC_OPS or masked):
            self._record(str(func))
        result = func(*args, **kwargs)
        for leaf in tree_leaves(result):
            if not isinstance(leaf, torch.Tensor):
                continue
            if on_host:
                self.host[leaf] = True
            else:  # also an in-place op that wrote device values into a host-marked tensor
                self.host.pop(leaf, None)
        return result

    def __enter__(self):
        original_tolist, original_to = torch.Tensor.tolist, torch.Tensor.to
        tracker = self

        def tolist(tensor):
            if tensor not in tracker.host:
                tracker._record("Tensor.tolist")
            return original_tolist(tensor)

        def to(tensor, *args, **kwargs):
            moved = original_to(tensor, *args, **kwargs)
            names_device = "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)
            if names_device and tensor in tracker.host:  # the transfer: a device tensor, never the host one itself
                moved = moved.clone() if moved is tensor else moved
                tracker.host.pop(moved, None)
            return moved

        self._patched = [("tolist", original_tolist), ("to", original_to)]
        torch.Tensor.tolist, torch.Tensor.to = tolist, to
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched:
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)
