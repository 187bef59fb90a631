"""The architecture matrix's in-process run (tests/model/test_arch_matrix.py): a tiny model of one transformers
architecture trained a few steps through the library's model path (pre-flight refusal, 4-bit NF4 base, k-bit
preparation, LoRA with the library's settings, checkpointing, the default dtype), its adapter saved by the library
and loaded back with plain `PeftModel.from_pretrained`.

Not `finetune/run.py` whole: the data, eval, checkpoint and plot stages are the same for every architecture and
cost ~10 s a run on a loaded CPU; the launches of a representative set under FSDP2 and FSDP1 run them whole.

    python tests/arch_matrix.py [MODEL_TYPE ...]    one line per architecture: trained / refused / failed, seconds
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

STEPS = 2  # two optimizer steps: the loss after the first must be below the first (a step that learns)
LIBRARY_LORA = {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"}  # as conftest.LIBRARY_LORA


@dataclass
class MatrixResult:
    model_type: str
    outcome: str  # "trained", "adapter-not-peft" (trained; plain PEFT cannot load its exported adapter), "refused"
    #               (the library's one-paragraph refusal), "failed" (anything else)
    detail: str
    losses: list[float]
    seconds: float


def arch_recipe(model_dir: Path, out_dir: Path, model_settings: dict | None = None):
    """The library's settings on `model_dir`: NF4, LoRA r16 / dropout 0.05 on all linears, checkpointing, dtype auto;
    `model_settings`: model keys the architecture needs (finetune/model/support.py's MODEL_SETTINGS)."""
    from finetune.recipe import validate_recipe

    return validate_recipe({
        "model": {"name_or_path": str(model_dir), **(model_settings or {})},
        "lora": dict(LIBRARY_LORA),
        "data": {"datasets": [{"path": str(out_dir / "unused.jsonl"), "format": "alpaca"}], "max_length": 64},
        "train": {"max_steps": STEPS, "micro_batch_size": 2, "gradient_checkpointing": True},
        "output": {"dir": str(out_dir)},
    })


def train_arch(model_type: str, model_dir: Path, out_dir: Path) -> MatrixResult:
    """Refusal check, build, STEPS optimizer steps on one fixed batch, library adapter save, plain PEFT reload."""
    import torch

    from finetune import model, outputs, parallel
    from finetune.errors import FinetuneError
    from finetune.model.experts import has_routed_experts
    from finetune.model.support import MODEL_SETTINGS

    start = time.perf_counter()
    recipe = arch_recipe(model_dir, out_dir, MODEL_SETTINGS.get(model_type, {}))
    try:
        model.load_config(recipe)  # the pre-flight refusal of a known-unsupported architecture happens here
        torch.manual_seed(0)
        # The single-process loader of a run: a meta skeleton filled tensor by tensor (4-bit quantized as read).
        peft_model = model.load_model(recipe, sharded=False, device=torch.device("cpu"), device_map=None,
                                      gradient_checkpointing=True).model
    except FinetuneError as exc:
        return MatrixResult(model_type, "refused", str(exc), [], time.perf_counter() - start)
    peft_model.train()
    key_map = outputs.adapter_key_map(peft_model)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    batch = torch.randint(3, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(STEPS):
        loss = peft_model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    state = parallel.trainable_state_dict(peft_model, key_map)
    outputs.save_adapter(peft_model.peft_config["default"], key_map, state, out_dir / "adapter")
    gap = _reload_with_plain_peft(model_dir, out_dir / "adapter", len(state), experts=has_routed_experts(peft_model))
    return MatrixResult(model_type, "trained" if gap is None else "adapter-not-peft", gap or "", losses,
                        time.perf_counter() - start)


def _reload_with_plain_peft(model_dir: Path, adapter_dir: Path, tensors: int, *, experts: bool) -> str | None:
    """The adapter loads with PEFT alone onto the unquantized stock base: no key missing or left over, and it changes
    the logits; returns why not where `finetune export` says plain PEFT cannot load a MoE adapter (support.py's
    ADAPTER_GAPS). A mixture-of-experts adapter goes through `finetune export` first (the run's adapter names its
    experts as finetune's per-expert layout does; the export, as the checkpoint does, for PEFT's own conversion)."""
    import torch
    from peft import PeftModel

    from finetune.model.classes import from_pretrained  # AutoModelForCausalLM's class, or the one it does not map

    if experts:
        from finetune.cli.command import main as finetune_main

        exported = adapter_dir.parent / "exported"
        assert finetune_main(["export", str(adapter_dir), str(exported)]) == 0
        adapter_dir = exported
    ids = torch.arange(3, 19).unsqueeze(0)
    base = from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        before = base(input_ids=ids).logits
    reloaded = PeftModel.from_pretrained(base, str(adapter_dir))
    if experts:
        # A second load_adapter on PEFT's fused experts reports its own conversion's keys as unexpected; export's
        # verdict is PEFT's load result of the same file against the stock base (missing, unexpected, values).
        verdicts = {item["runtime"].split(" ")[0]: item for item in
                    json.loads((adapter_dir / "runtimes.json").read_text())}
        if verdicts["PEFT"]["status"] != "valid":
            return "; ".join(verdicts["PEFT"]["reasons"])[:300]
    else:
        # PEFT warns of missing keys only; a saved tensor it found no module for passes silently: ask its load result.
        placed = reloaded.load_adapter(str(adapter_dir), adapter_name="probe")
        missing = [key for key in placed.missing_keys if ".lora_" in key and ".probe" in key]
        assert not placed.unexpected_keys and not missing, (
            f"{adapter_dir} ({tensors} tensors): unexpected {placed.unexpected_keys[:4]}, missing {missing[:4]}")
        reloaded.delete_adapter("probe")
    with torch.no_grad():
        after = reloaded(input_ids=ids).logits
    assert (after - before).abs().max() > 0, f"{adapter_dir}: the reloaded adapter does not change the logits"
    return None


def run_one(model_type: str, root: Path) -> dict:
    """One row of the matrix: {"outcome", "detail", "seconds"} (module docstring's outcomes, and `not-a-decoder`,
    `no-tiny`: the tiny model could not be built from transformers' defaults, so it is untried)."""
    import traceback

    from finetune.cli.tiny_arch import build_tiny_arch, decoder_kind

    start = time.perf_counter()
    kind = decoder_kind(model_type)
    if kind != "decoder":
        return {"outcome": "not-a-decoder", "detail": kind, "seconds": 0.0}
    try:
        folder = build_tiny_arch(model_type, root / model_type)
    except Exception as exc:  # noqa: BLE001 - a row per architecture
        return {"outcome": "no-tiny", "detail": f"{type(exc).__name__}: {_first_line(exc)}",
                "seconds": round(time.perf_counter() - start, 1)}
    try:
        result = train_arch(model_type, folder, root / f"run-{model_type}")
        detail = result.detail.replace("\n", " ")[:300] or " ".join(f"{x:.3f}" for x in result.losses)
        return {"outcome": result.outcome, "detail": detail, "seconds": round(result.seconds, 1)}
    except Exception as exc:  # noqa: BLE001
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return {"outcome": "failed", "detail": f"{type(exc).__name__}: {_first_line(exc)} @ "
                f"{Path(where.filename).name}:{where.lineno}", "seconds": round(time.perf_counter() - start, 1)}


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0][:240] if str(exc).strip() else ""


def _forked(model_type: str, root: Path, timeout: float) -> dict:
    """`run_one` in a forked child (the imports are the parent's): a hang or a crash is one row, not the walk's end."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=lambda: send.send(run_one(model_type, root)), daemon=True)
    start = time.perf_counter()
    child.start()
    if receive.poll(timeout):
        row = receive.recv()
        child.join(10)
        return row
    child.kill()
    child.join()
    return {"outcome": "failed", "detail": f"no result in {timeout:.0f} s (exit code {child.exitcode})",
            "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str]) -> None:
    """`python tests/arch_matrix.py [MODEL_TYPE ...]`: a line per architecture. `--all --json PATH`: every model type
    with a causal-LM or image-text-to-text class (`finetune.cli.tiny_arch.matrix_model_types`), each in a forked
    child with `--timeout` seconds, the rows written to PATH (`make models-matrix`)."""
    import argparse
    import json
    import tempfile

    import torch
    import transformers

    from finetune import quiet
    from finetune.cli.tiny_arch import matrix_model_types, text_causal_lm_types

    parser = argparse.ArgumentParser()
    parser.add_argument("model_types", nargs="*")
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--timeout", type=float, default=180)
    args = parser.parse_args(argv)
    quiet.install()
    root = Path(tempfile.mkdtemp(prefix="arch-matrix-"))
    types = args.model_types or (matrix_model_types() if args.all else text_causal_lm_types())
    rows = {}
    for model_type in types:
        row = _forked(model_type, root, args.timeout) if args.json else run_one(model_type, root)
        rows[model_type] = row
        for leftover in (root / model_type, root / f"run-{model_type}"):  # ~60 MB a type: 18 GB for --all otherwise
            shutil.rmtree(leftover, ignore_errors=True)
        print(f"{model_type}\t{row['outcome']}\t{row['seconds']}\t{row['detail'][:200]}", flush=True)
        if args.json:  # after every row: an interrupted walk keeps what it measured
            args.json.write_text(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                                             "rows": dict(sorted(rows.items()))}, indent=1) + "\n")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import conftest  # noqa: F401  - the suite's hermetic cache, CUDA hidden

    main(sys.argv[1:])
