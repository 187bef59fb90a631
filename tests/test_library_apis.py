"""Every name finetune imports from torch, transformers, PEFT, accelerate, bitsandbytes, datasets, DeepSpeed and
safetensors exists in the installed versions, and so does every dotted `torch.` / `dist.` attribute it reads.

The compat job (`make test-compat`) runs this at both ends of the declared range, which catches an API newer than the
floor (torch 2.13's `dist.all_gather_single` was one: every FSDP2 run on torch < 2.13 died at the first layer) or one
removed in the newest release, on code paths a CPU run never reaches too (CUDA-only branches, optional exports).
A name behind `try: ... except ImportError` (or AttributeError) is a handled fallback and is not required.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "finetune"
LIBRARIES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "datasets", "deepspeed", "safetensors")


def _guarded(tree: ast.AST) -> set[int]:
    """Line numbers inside a `try` whose handlers catch ImportError / AttributeError / ModuleNotFoundError / Exception."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            names = set()
            for handler in node.handlers:
                kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                names |= {k.id for k in kinds if isinstance(k, ast.Name)}
            if names & {"ImportError", "ModuleNotFoundError", "AttributeError", "Exception"}:
                for child in node.body:
                    lines |= set(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _aliases(tree: ast.AST) -> dict[str, str]:
    """The names a file binds to library modules (`import torch.distributed as dist` -> {"dist": "torch.distributed"})."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "torch"
    return aliases


def _dotted(node: ast.Attribute, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def used_names() -> dict[str, list[str]]:
    """{"module:name" or "dotted.path": [file:line, ...]} for every unguarded use."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        guarded, aliases = _guarded(tree), _aliases(tree)
        where = f"{path.relative_to(PACKAGE.parent)}:"
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in guarded:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES and not node.level:
                for alias in node.names:
                    found.setdefault(f"{node.module}:{alias.name}", []).append(f"{where}{node.lineno}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in LIBRARIES:
                        found.setdefault(f"{alias.name}:", []).append(f"{where}{node.lineno}")
            elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
                dotted = _dotted(node, aliases)
                if dotted:
                    found.setdefault(dotted, []).append(f"{where}{node.lineno}")
    return found


def _resolves(key: str) -> bool:
    if ":" in key:
        module, _, name = key.partition(":")
        try:
            imported = importlib.import_module(module)
        except ImportError:
            return False
        if not name or hasattr(imported, name):
            return True
        try:
            importlib.import_module(f"{module}.{name}")
            return True
        except ImportError:
            return False
    parts = key.split(".")
    for split in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_the_scan_sees_the_uses_it_is_for():
    """The scan itself can fail: it finds a known import, a known dotted read, and skips a guarded fallback."""
    names = used_names()
    assert "peft:PeftModel" in names and "torch.distributed.all_gather" in names and "torch.no_grad" in names
    assert "peft.utils.transformers_weight_conversion:convert_peft_adapter_state_dict_for_transformers" not in names
    assert not _resolves("torch.distributed:no_such_collective") and not _resolves("torch.distributed.no_such_thing")


def test_every_library_name_finetune_uses_exists_in_the_installed_versions():
    pytest.importorskip("deepspeed")  # the extra is part of the tested range (make install, make test-compat)
    missing = {key: where for key, where in used_names().items() if not _resolves(key)}
    versions = {name: getattr(importlib.import_module(name), "__version__", "?") for name in LIBRARIES}
    assert not missing, f"not in {versions}: " + "; ".join(f"{k} ({', '.join(v[:3])})" for k, v in sorted(missing.items()))
