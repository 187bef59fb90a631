"""Filling a meta skeleton one module at a time: base weights read from the checkpoint (quantized on the rank's device
exactly as `from_pretrained` does), LoRA from its seed (or model.adapter, with every trainable tensor it holds); tied
weights built once for every owner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from finetune.errors import ModelLoadError
from finetune.host_memory import release_freed_memory
from finetune.model.quantization.prequantized import PackedLayout, packed_parameter
from finetune.model.sources.files import CheckpointIndex, TensorReader
from finetune.model.sources.shard_reads import PendingQuantState, RankShard, finish_quant_states, own_parameter


def checkpoint_name(model_name: str) -> str:
    """`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` -> `model.layers.0.self_attn.q_proj.weight`;
    a modules_to_save module's frozen original and trainable copy (`mlp.gate.original_module.weight`,
    `mlp.gate.modules_to_save.default.weight`: lora.train_router) both start from the checkpoint's `mlp.gate.weight`."""
    import re

    from finetune.model.lora.init import lora_tensor_name

    return re.sub(r"\.(original_module|modules_to_save\.[^.]+)\.", ".", lora_tensor_name(model_name))


def tied_groups(model: nn.Module) -> dict[int, list[str]]:
    """Names of the meta parameters, grouped by tensor (tied weights, such as lm_head and embeddings, share one)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.is_meta:
            groups.setdefault(id(param), []).append(name)
    return groups


def is_lora_name(name: str) -> bool:
    return ".lora_" in name


def untie_stored_apart(model: nn.Module, index: CheckpointIndex) -> list[tuple[str, str]]:
    """Untie, in the meta skeleton, each tied weight the checkpoint stores a second time with other values, as
    transformers' `from_pretrained` does: config.json says tie_word_embeddings, the files hold a `lm_head.weight` of
    their own, and transformers loads both and leaves them apart (with a warning). The tied skeleton would use the
    embeddings as the head and never read the stored one: another model than the one export and generate load.
    Both tensors are compared in the dtype the model holds them in (as transformers compares the loaded
    parameters), a block of rows at a time; equal ones stay tied. Returns (untied name, the name it was tied to)
    in checkpoint names."""
    untied = []
    reader = TensorReader(index)
    try:
        for group in tied_groups(model).values():
            stored = [name for name in group if checkpoint_name(name) in index.shapes]
            for name in stored[1:]:
                module_name, _, attr = name.rpartition(".")
                module = model.get_submodule(module_name)
                param = module._parameters[attr]
                if _same_values(reader, checkpoint_name(stored[0]), checkpoint_name(name), param.dtype):
                    continue
                module._parameters[attr] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                                        requires_grad=param.requires_grad)
                untied.append((checkpoint_name(name), checkpoint_name(stored[0])))
    finally:
        reader.close()
    for module in model.modules():  # transformers' record of what is tied (read by save_pretrained), as it updates it
        tied_keys = getattr(module, "all_tied_weights_keys", None)
        if isinstance(tied_keys, dict):
            for name, _ in untied:
                tied_keys.pop(name, None)
    return untied


def _same_values(reader: TensorReader, first: str, second: str, dtype: torch.dtype) -> bool:
    shape = reader.index.shapes[first]
    if shape != reader.index.shapes[second]:
        return False
    if not shape:
        return torch.equal(reader.get(first).to(dtype), reader.get(second).to(dtype))
    rows, width = shape[0], torch.Size(shape[1:]).numel()
    step = max(1, (16 << 20) // width)  # 16M values (~64 MiB in fp32) a block of each tensor
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        if not torch.equal(reader.get_rows(first, start, stop).to(dtype), reader.get_rows(second, start, stop).to(dtype)):
            return False
    return True


# --------------------------------------------------------------------------------------------- materialising
@dataclass
class Materializer:
    """Fills the meta tensors of one module at a time: base weights from the checkpoint, LoRA from its seed."""

    reader: TensorReader
    device: torch.device
    load_dtype: torch.dtype
    lora_seed: int
    names: dict[int, str]  # id(module) -> its name in the PeftModel, taken before any wrapping
    aliases: dict[str, list[tuple[nn.Module, str]]]  # tied parameters: every (module, attribute) sharing one tensor
    lora_checksum: float = 0.0
    trace: bool = False
    lora_start: dict | None = None  # model.adapter's tensors: every trainable tensor starts from them (`_from_start`)
    peak_alive_bytes: int = 0  # with trace: the most tensor bytes alive right after any unit was built
    trace_log: list[tuple[str, int]] = field(default_factory=list)
    shard: RankShard | None = None  # FSDP2: read and quantize only this rank's chunk (shard_reads.py)
    _pending: list[PendingQuantState] = field(default_factory=list)
    packed: PackedLayout | None = None  # a pre-quantized checkpoint: 4-bit weights from their stored bytes

    def module(self, module: nn.Module) -> None:
        """Materialise the parameters and buffers `module` owns directly (FSDP1's `param_init_fn` contract), and move
        the buffers it computed at init to the device (`place_buffers`)."""
        prefix = self.names.get(id(module))
        if prefix is None:
            return
        for attr, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                self._parameter(module, f"{prefix}.{attr}" if prefix else attr, attr, param)
        for attr, buffer in list(module._buffers.items()):
            stored = checkpoint_name(f"{prefix}.{attr}" if prefix else attr)
            # A persistent buffer made at init (the skeleton keeps buffers real) is read from the checkpoint where it
            # is there, as from_pretrained reads it: DeepSeek-V4's hash-routing table `tid2eid` is zeros at init.
            if buffer is not None and (buffer.is_meta or (attr not in module._non_persistent_buffers_set
                                                          and stored in self.reader.index.shapes)):
                module._buffers[attr] = self.reader.get(stored).to(self.device, buffer.dtype)
        place_buffers(module, self.device)

    def tree(self, root: nn.Module) -> None:
        """Materialise everything still on the meta device under `root` (one unit: a decoder layer, or the rest), its
        init-time buffers moved to the device.

        FSDP1 calls it for every module it wraps, most of them already built by their unit: those cost nothing."""
        unbuilt = any(t.is_meta for t in root.parameters()) or any(_elsewhere(b, self.device) for b in root.buffers())
        if not unbuilt:
            return
        release_freed_memory()  # the previous unit's full tensors, freed when FSDP sharded it
        for module in root.modules():
            self.module(module)
        if self.shard is not None:  # the unit's quant states, from every rank's absmax (one collective)
            finish_quant_states(self._pending, shard=self.shard, device=self.device, load_dtype=self.load_dtype)
        if self.trace:
            alive = alive_tensor_bytes()
            self.peak_alive_bytes = max(self.peak_alive_bytes, alive)
            self.trace_log.append((self.names.get(id(root), "?") or "root", alive))
        if self.names.get(id(root)) == "":  # the root unit is built last: the checkpoint files can be closed
            self.reader.close()

    def _parameter(self, module: nn.Module, name: str, attr: str, param: nn.Parameter) -> None:
        owners = self.aliases.get(name, [(module, attr)])
        if not owners:
            return  # a tied alias (lm_head of tied embeddings): built with the tensor the checkpoint stores
        if is_lora_name(name):
            new = self._lora(name, param)
        elif self.lora_start is not None and param.requires_grad:
            new = self._from_start(name, param)
        else:
            new = self._base(name, param)
        for owner, owner_attr in owners:
            owner._parameters[owner_attr] = new

    def _base(self, name: str, param: nn.Parameter) -> nn.Parameter:
        key = checkpoint_name(name)
        if type(param).__name__ == "Params4bit" and self.packed is not None:
            return packed_parameter(self.reader, key, param, device=self.device, layout=self.packed, shard=self.shard)
        if self.shard is not None:
            return own_parameter(self.reader, key, param, shard=self.shard, device=self.device,
                                 load_dtype=self.load_dtype, pending=self._pending)
        if type(param).__name__ == "Params4bit":
            import bitsandbytes as bnb

            # As transformers' Bnb4bitQuantize: cast to the load dtype on the device, then quantize there.
            value = self.reader.get(key).to(device=self.device, dtype=self.load_dtype)
            return bnb.nn.Params4bit(value, requires_grad=False, **param.__dict__).to(self.device)
        value = self.reader.get(key)
        if ".modules_to_save." in name:  # a trainable copy (fp32) of a module loaded in model.dtype, as PEFT copies it
            value = value.to(self.load_dtype)
        return nn.Parameter(value.to(device=self.device, dtype=param.dtype), requires_grad=param.requires_grad)

    def _from_start(self, name: str, param: nn.Parameter) -> nn.Parameter:
        """A trainable tensor that is no LoRA (a lora.bias bias, a modules_to_save router copy) from model.adapter, as
        PeftModel.from_pretrained loads it: the checkpoint's value is what the adapter's run started from, not what it
        trained. Whole on every rank (FSDP2 cuts it like a LoRA tensor)."""
        from finetune.model.lora.init import start_value

        value = start_value(self.lora_start, name, param.shape)
        return nn.Parameter(value.to(device=self.device, dtype=param.dtype), requires_grad=True)

    def _lora(self, name: str, param: nn.Parameter) -> nn.Parameter:
        from finetune.model.lora.init import init_lora_tensor, lora_fingerprint

        value = torch.empty(param.shape, dtype=param.dtype, device="cpu")
        if not init_lora_tensor(value, name, self.lora_seed, self.lora_start):
            raise ModelLoadError(f"{name}: sharded loading does not know how to initialise this adapter tensor. "
                                 "Fix: set parallel.sharded_loading: false.")
        self.lora_checksum += lora_fingerprint(value, name)
        return nn.Parameter(value.to(self.device), requires_grad=param.requires_grad)


def place_buffers(module: nn.Module, device: torch.device) -> None:
    """Move the real buffers `module` owns directly that live on another device to `device` (meta ones are built).

    Why: the skeleton is built with real buffers (`init_empty_weights(include_buffers=False)`: rotary `inv_freq`,
    Gemma's `embed_scale`, whatever a model computes at init rather than loads), so they are made on the CPU. Under
    FSDP, `fully_shard` / FSDP1's `device_id` move them with the parameters; a whole model (single process, DDP,
    DeepSpeed) has no such step, and a CPU buffer beside GPU parameters costs a blocking host-to-device copy in every
    forward (transformers' rotary code moves `inv_freq` to the activations' device each call) and, under DDP, a
    broadcast of CPU buffers before every forward. Moving them here, as each unit is built, serves every strategy."""
    for attr, buffer in module._buffers.items():
        if buffer is not None and _elsewhere(buffer, device):
            module._buffers[attr] = buffer.to(device)


def _elsewhere(tensor: torch.Tensor, device: torch.device) -> bool:
    """A real tensor on another device than `device` (a device without an index means the current one of its type)."""
    if tensor.is_meta:
        return False
    return tensor.device.type != device.type or (device.index is not None and tensor.device.index != device.index)


def materializer(model: nn.Module, index: CheckpointIndex, *, device: torch.device, load_dtype: torch.dtype,
                 lora_seed: int, trace: bool = False, lora_start: dict | None = None,
                 shard: RankShard | None = None, packed: PackedLayout | None = None) -> Materializer:
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    aliases: dict[str, list[tuple[nn.Module, str]]] = {}
    for group in tied_groups(model).values():
        if len(group) == 1:
            continue
        # The checkpoint holds one of the tied names (the embeddings): build under that one, for every owner.
        stored = next((name for name in group if checkpoint_name(name) in index.shapes), group[0])
        owners = []
        for name in group:
            module_name, _, attr = name.rpartition(".")
            owners.append((model.get_submodule(module_name), attr))
            aliases[name] = []
        aliases[stored] = owners
    return Materializer(TensorReader(index), device, load_dtype, lora_seed, names, aliases, trace=trace,
                        lora_start=lora_start, shard=shard, packed=packed)


def alive_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (each storage once; DTensors through their local shard).

    Deterministic accounting for tests and benchmarks: what loading keeps, whatever the allocator does.
    """
    import gc
    import warnings

    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0
    with warnings.catch_warnings():  # isinstance() on some deprecated module-level objects warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if type(obj) is DTensor or obj.is_meta:
            continue  # a DTensor's local shard is a tensor of its own, counted there
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.data_ptr() in seen or storage.device.type == "meta":
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
