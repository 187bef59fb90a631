"""The base's checkpoint files: where a model's safetensors live, their headers, and one tensor at a time from them.

A leaf of the loader: it knows files, not models (the skeleton and its filling are in loading.py and materialize.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from finetune.errors import ModelLoadError
from finetune.recipe import Recipe

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors' dtype names -> (torch's name, bytes per element)
_DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
           "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
           "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1)}


@dataclass(frozen=True)
class DerivedView:
    """A model tensor computed from stored ones by its layout's owner (an expert family: gpt-oss's transposed,
    interleaved or MXFP4 experts, finetune/model/experts/families/): `read(get)` builds it, `get(stored, index)`
    reading only `stored[index]` (safetensors slicing on the leading dimensions, counted as read)."""

    sources: tuple[str, ...]
    read: Callable[[Callable[[str, tuple], torch.Tensor]], torch.Tensor]


@dataclass
class CheckpointIndex:
    """Where each tensor of a safetensors checkpoint lives, and its shape (from the file headers only)."""

    folder: Path
    files: dict[str, Path] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # A model tensor stored under another name, or as part of a stored tensor (transformers' key renames and expert
    # fusion, finetune/model/sources/conversions.py): model name -> (name in the file, expert index or None, part,
    # parts), or a `DerivedView` for a layout that is no row block of one stored tensor.
    views: dict[str, tuple[str, int | None, int, int] | DerivedView] = field(default_factory=dict)
    # Views of an expert stored (in, out) (Llama 4's fused experts): the part is a block of columns, read transposed.
    transposed: set[str] = field(default_factory=set)
    # The stored dtype of each tensor in the files (headers only), torch's name: bfloat16, uint8, float8_e4m3fn...
    dtypes: dict[str, str] = field(default_factory=dict)

    def itemsize(self, name: str) -> int | None:
        """Bytes per stored element of `name` (None: not known, e.g. a view)."""
        return next((size for torch_name, size in _DTYPES.values() if torch_name == self.dtypes.get(name)), None)

    def add_view(self, name: str, view: tuple[str, int | None, int, int] | DerivedView, shape: tuple[int, ...]) -> None:
        """`name` is read through `view` (the stored tensor's name, expert index or None, part, parts; or derived)."""
        self.views[name] = view
        self.files[name] = self.files[view.sources[0] if isinstance(view, DerivedView) else view[0]]
        self.shapes[name] = shape


def conversion_command(folder: Path) -> str:
    return (f"python -m finetune.model.convert {folder}  (rewrites the pickle shards as model*.safetensors "
            "beside them, reading them with torch's weights-only loader)")


def checkpoint_index(folder: Path) -> CheckpointIndex:
    """Read the safetensors headers of a checkpoint folder (one file, or sharded with an index file).

    A folder holding both model.safetensors and an index is read as transformers' `from_pretrained` reads it: the
    single file, the index ignored. transformers' own `save_pretrained` leaves such a folder (a sharded save, then a
    single-file save into the same folder deletes the old shards but not their index), and a run must train on the
    weights that export and generate (transformers) load later."""
    from safetensors import safe_open

    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if (folder / SINGLE_FILE).exists():
        names_by_file = {SINGLE_FILE: []}
    elif index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"{index_path}: not a valid safetensors index ({exc}). Fix: re-download the model.") from None
        names_by_file: dict[str, list[str]] = {}
        for name, file_name in weight_map.items():
            names_by_file.setdefault(file_name, []).append(name)
    else:
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        if pickles:
            raise ModelLoadError(
                f"{folder}: the weights are pickle files ({', '.join(pickles[:3])}), which cannot be read one tensor at a "
                f"time, so sharded loading would need a full copy in RAM on every rank. Fix: convert them once with "
                f"`{conversion_command(folder)}`, or set parallel.sharded_loading: false."
            )
        raise ModelLoadError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}. Fix: point model.name_or_path at a saved "
                             "transformers folder with safetensors weights.")
    index = CheckpointIndex(folder=folder)
    for file_name, listed in names_by_file.items():
        path = folder / file_name
        if not path.exists():
            raise ModelLoadError(
                f"{index_path}: names the shard {file_name} (for {listed[0]} and {len(listed) - 1} more tensors) but "
                f"{path} does not exist. Fix: download the missing shard (or the whole model) again."
            )
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:  # noqa: BLE001 (safetensors raises its own SafetensorError)
            raise ModelLoadError(
                f"{path}: not a readable safetensors file ({str(exc).strip()[:200]}); a truncated download or an "
                "interrupted copy leaves such a file. Fix: download or copy that shard (or the whole model) again."
            ) from None
        for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            stored = handle.get_slice(name)
            index.files[name] = path
            index.shapes[name] = tuple(stored.get_shape())
            index.dtypes[name] = _DTYPES.get(stored.get_dtype(), (stored.get_dtype().lower(), None))[0]
    return index


def checkpoint_folder(recipe: Recipe) -> Path:
    """The local folder holding the base's weights: the recipe's path, the converted GGUF folder, or the hub cache."""
    from finetune.model.sources.hub import is_local, load_error, offline_guard

    name = recipe.model.name_or_path
    if recipe.model.gguf_file:
        from finetune.model.sources.gguf import converted_folder

        return converted_folder(name, recipe.model.gguf_file)
    if is_local(name):
        return Path(name).expanduser()
    offline_guard(name)
    from huggingface_hub import snapshot_download

    from finetune.distributed import print0

    # A first download of a large base takes minutes with the hub's bars off (quiet.py): said first (bug bash)
    print0(f"[finetune] model: fetching {name} from the hub into its cache (files already there are not downloaded "
           "again)")

    try:  # config, tokenizer and safetensors only: never the pickle or GGUF duplicates a repo may also hold, nor the
        # original-format copy in original/ (openai/gpt-oss-*: original/*.safetensors, 13 GB more for 20b; metal/)
        return Path(snapshot_download(name, revision=recipe.model.revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"],
                                      ignore_patterns=["original/*", "metal/*"]))
    except Exception as exc:  # noqa: BLE001 (hub errors come in many classes; all mean "not available here")
        raise load_error("model", name, exc) from None


class TensorReader:
    """One tensor (or some rows, or a flat range of one) at a time from memory-mapped safetensors files (file pages are
    shared, not process memory). `bytes_read` counts the tensor bytes taken from the files, as stored (not timed)."""

    def __init__(self, index: CheckpointIndex):
        self.index = index
        self._handles: dict[Path, object] = {}
        self.bytes_read = 0

    def _handle(self, stored: str):
        from safetensors import safe_open

        path = self.index.files[stored]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def _counted(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def _stored_as(self, name: str) -> str | None:
        """The name in the files of a tensor stored whole (itself, or under transformers' renamed key); None for a
        part of a fused tensor (one expert of a 3-D tensor, or one half of a fused projection) or a derived one."""
        if isinstance(self.index.views.get(name), DerivedView):
            return None
        stored, expert, _, parts = self.index.views.get(name, (name, None, 0, 1))
        return stored if expert is None and parts == 1 else None

    def _part(self, name: str) -> torch.Tensor:
        """A tensor stored inside another (conversions.py): only its own bytes are read, the rows of
        part `part` of `parts` (torch.chunk's split) of the whole tensor or of expert `expert`'s slice; a `DerivedView`
        reads what its layout needs."""
        if isinstance(self.index.views[name], DerivedView):
            return self.index.views[name].read(
                lambda stored, at: self._counted(self._handle(stored).get_slice(stored)[at]))
        stored, expert, part, parts = self.index.views[name]
        handle = self._handle(stored)
        if expert is None and parts == 1:
            return self._counted(handle.get_tensor(stored))
        if name in self.index.transposed:
            return self._transposed_rows(name, 0, self.index.shapes[name][0])
        view = handle.get_slice(stored)
        rows = self.index.shapes[stored][0 if expert is None else 1]
        size = -(-rows // parts)
        first, last = part * size, min(rows, (part + 1) * size)
        return self._counted(view[first:last] if expert is None else view[expert, first:last])

    def _transposed_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of an expert weight stored (in, out) (Llama 4): columns of the expert's slice, part
        `part`'s block of them, transposed to (out, in); only those columns' bytes are read."""
        stored, expert, part, parts = self.index.views[name]
        size = -(-self.index.shapes[stored][2] // parts)
        first, stop = part * size, min(stop, self.index.shapes[name][0])  # never into the next part's columns
        columns = self._handle(stored).get_slice(stored)[expert, :, first + start : first + stop]
        return self._counted(columns).t().contiguous()

    def get(self, name: str) -> torch.Tensor:
        stored = self._stored_as(name)
        return self._part(name) if stored is None else self._counted(self._handle(stored).get_tensor(stored))

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor (dim 0): only their bytes are read (a part of a fused tensor: read whole,
        except an expert stored (in, out), whose rows are stored columns)."""
        if name in self.index.transposed:
            return self._transposed_rows(name, start, stop)
        stored = self._stored_as(name)
        if stored is None:
            return self._part(name)[start:stop]
        return self._counted(self._handle(stored).get_slice(stored)[start:stop])

    def get_flat_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the flattened tensor, 1-D. A matrix is read in at most three slices (the end of
        a first row, whole rows, the start of a last row), so exactly the range's bytes are read; a tensor of other
        rank is read in whole rows and trimmed; a part of a fused tensor is read whole and cut (an expert stored
        (in, out): its whole rows around the range, then trimmed)."""
        if name in self.index.transposed:  # whole rows (stored columns) around the range, then trimmed
            width = self.index.shapes[name][1]
            first, last = start // width, -(-stop // width)
            return self._transposed_rows(name, first, last).reshape(-1)[start - first * width : stop - first * width]
        stored = self._stored_as(name)
        if stored is None:
            return self._part(name).reshape(-1)[start:stop]
        shape = self.index.shapes[stored]
        width = math.prod(shape[1:])
        first, last = start // width, -(-stop // width)
        view = self._handle(stored).get_slice(stored)
        if start >= stop:
            return view[0:0].reshape(-1)
        if len(shape) != 2:
            return self._counted(view[first:last]).reshape(-1)[start - first * width : stop - first * width]
        if start % width == 0 and stop % width == 0:  # whole rows: one slice, no concatenation
            return self._counted(view[first:last]).reshape(-1)
        if first + 1 == last:  # within one row
            return self._counted(view[first : first + 1, start - first * width : stop - first * width]).reshape(-1)
        head_end, tail_start = (first + 1) * width, (last - 1) * width
        head = view[first : first + 1, start - first * width :] if start % width else view[first : first + 1]
        tail = view[last - 1 : last, : stop - tail_start] if stop % width else view[last - 1 : last]
        parts = [head, view[first + 1 : last - 1], tail] if head_end < tail_start else [head, tail]
        return torch.cat([self._counted(part).reshape(-1) for part in parts])

    def close(self) -> None:
        self._handles.clear()


def convert_to_safetensors(folder: Path) -> list[Path]:
    """Rewrite pickle weight files (`*.bin`) as safetensors beside them, one shard at a time (weights-only load)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    written = []
    shards = sorted(folder.glob("pytorch_model*.bin")) or sorted(folder.glob("*.bin"))
    weight_map = {}
    for shard in shards:
        state = torch.load(shard, map_location="cpu", weights_only=True, mmap=True)
        target = shard.with_name(shard.name.replace("pytorch_model", "model").removesuffix(".bin") + ".safetensors")
        tmp = target.with_suffix(".safetensors.tmp")
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
        tmp.replace(target)
        weight_map.update({name: target.name for name in state})
        written.append(target)
    if len(written) > 1:
        tmp = folder / (INDEX_FILE + ".tmp")
        tmp.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2), encoding="utf-8")
        tmp.replace(folder / INDEX_FILE)
    return written
