"""finetune.training.loss.token_loss_sum equals the full-logits loss (train.loss_sum's semantics): loss, token count and LoRA
gradients in fp32, single process and under real 2-process DDP / FSDP1 / FSDP2 runs, while never handing full-vocabulary logits to the loss.

Run as a script under torchrun, this file is the worker of the 2-process test.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from finetune.training import loss as chunked

CPU = torch.device("cpu")


def reference_loss_sum(model, batch, device):
    """The semantics to match (train.loss_sum as of this file): full logits, fp32 cross-entropy, labels shifted by one.

    Kept here, not imported, so that the test still compares against full logits after train.py delegates to
    finetune.training.loss.
    """
    batch = {k: v.to(device) for k, v in batch.items()}
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total, int((labels != -100).sum())


def lora_model(model_dir, *, trainable_head: bool = False, family_config=None):
    """fp32 tiny model + LoRA with non-zero B (so every LoRA parameter gets a gradient)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = (AutoModelForCausalLM.from_config(family_config, dtype=torch.float32) if family_config is not None
            else AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    if trainable_head:
        model.get_output_embeddings().weight.requires_grad_(True)
    return model


def batches(vocab: int, seed: int = 1) -> dict[str, dict[str, torch.Tensor]]:
    """A right-padded batch (attention_mask) and a packed one (restarting position_ids), prompts not trained."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 48), generator=generator)
    labels = ids.clone()
    labels[:, :12] = -100
    mask = torch.ones_like(ids)
    mask[1, 37:] = 0
    padded_labels = labels.clone()
    padded_labels[1, 37:] = -100
    positions = torch.cat([torch.arange(20), torch.arange(28)]).repeat(3, 1)
    return {"padded": {"input_ids": ids, "attention_mask": mask, "labels": padded_labels},
            "packed": {"input_ids": ids, "position_ids": positions, "labels": labels}}


def loss_and_grads(model, batch, function) -> tuple[float, int, list[torch.Tensor | None]]:
    model.zero_grad(set_to_none=True)
    value, count = function(model, batch, CPU)
    value.backward()
    grads = [p.grad.detach().clone() if p.grad is not None else None for p in model.parameters() if p.requires_grad]
    return float(value.detach()), count, [g.to_local() if hasattr(g, "to_local") else g for g in grads]


def compare(model, batch) -> dict[str, float]:
    """Relative differences of token_loss_sum vs train.loss_sum: loss, no-grad (eval) loss, worst gradient."""
    want, want_count, want_grads = loss_and_grads(model, batch, reference_loss_sum)
    got, got_count, got_grads = loss_and_grads(model, batch, chunked.token_loss_sum)
    assert got_count == want_count and want_count > 0
    assert all((a is None) == (b is None) for a, b in zip(want_grads, got_grads))
    assert sum(1 for g in want_grads if g is not None and g.abs().sum() > 0) > 0
    with torch.no_grad():
        want_eval, got_eval = float(reference_loss_sum(model, batch, CPU)[0]), float(chunked.token_loss_sum(model, batch, CPU)[0])
    grad_rel = max(float((a - b).abs().max() / (a.abs().max() + 1e-12)) for a, b in zip(want_grads, got_grads) if a is not None)
    return {"loss": abs(got - want) / abs(want), "eval": abs(got_eval - want_eval) / abs(want_eval), "grad": grad_rel}


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_equal_to_train_loss_sum_over_many_chunks(tiny_llama, monkeypatch, kind):
    model = lora_model(tiny_llama)
    monkeypatch.setattr(chunked, "CHUNK_LOGIT_ELEMENTS", model.config.vocab_size * 16)  # 16 tokens a chunk: 6 chunks
    calls = []
    original = chunked._ChunkedHeadLoss.apply
    monkeypatch.setattr(chunked._ChunkedHeadLoss, "apply", lambda *a: calls.append(a[0].shape) or original(*a))
    diff = compare(model, batches(model.config.vocab_size)[kind])
    assert diff["loss"] < 1e-5 and diff["eval"] < 1e-5 and diff["grad"] < 1e-4, diff
    assert calls and calls[0][0] > 16  # the chunked path ran over the trained positions only
    assert calls[0][0] == int((batches(model.config.vocab_size)[kind]["labels"][:, 1:] != -100).sum())


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_a_micro_batch_loss_makes_no_host_sync(tiny_llama, monkeypatch, kind):
    """One micro-batch's loss, forward and backward (token_loss_sum for SFT, sequence_logps for DPO), and the no-grad
    eval loss make no host sync: the trained positions and their count come from the data loader's host labels, and
    the head gathers its rows by index. Before: `int(count)` of the labels on the device, and the boolean-mask
    selection `hidden[mask]` (a nonzero) in the forward, its masked index_put in the backward.

    This machine has no CUDA, so the sync is simulated by counting the host-transfer ops (HostSyncs,
    tests/training/host_syncs.py): the batch's tensors are host memory, as the loader gives them, and what
    `.to(device)` returns is device memory, as on a GPU machine. Counted are the syncs finetune's code asks for;
    transformers' own mask preparation makes 1-2 per forward (`padding_mask.all()` with an attention mask,
    `find_packed_sequence_indices` with packed position_ids), outside this module. The head's transform is measured
    once per run, at its first loss (`install`: one probe forward, whose logits are read on the host), before the
    micro-batches counted here."""
    model = lora_model(tiny_llama)
    monkeypatch.setattr(chunked, "CHUNK_LOGIT_ELEMENTS", model.config.vocab_size * 16)  # several chunks
    batch = batches(model.config.vocab_size)[kind]
    assert chunked.install(model, CPU) is not None
    trained = int((batch["labels"][:, 1:] != -100).sum())
    with HostSyncs(host=batch.values()) as syncs:  # what the SFT objective calls: the loss and the argmax hits
        value, count, _ = chunked.token_loss_and_correct(model, batch, CPU)
        value.backward()
        with torch.no_grad():
            chunked.token_loss_and_correct(model, batch, CPU)
    assert syncs.ours() == [], syncs.ours()
    assert type(count) is int and count == trained  # a Python int without asking the device
    with HostSyncs(host=batch.values()) as syncs:
        logps, counts = chunked.sequence_logps(model, batch, CPU)
        logps.sum().backward()
    assert syncs.ours() == [], syncs.ours()
    assert int(counts.sum()) == trained


@pytest.mark.parametrize("trainable_head", [False, True])
def test_token_accuracy_is_the_full_logits_argmax_count(tiny_llama, monkeypatch, trainable_head):
    """mean_token_accuracy's numerator (TRL's: trained tokens whose argmax logit is the label), read off each chunk's
    logits inside the forward, equals the count over full logits, with and without grad, over several chunks."""
    model = lora_model(tiny_llama, trainable_head=trainable_head)
    monkeypatch.setattr(chunked, "CHUNK_LOGIT_ELEMENTS", model.config.vocab_size * 16)  # 16 tokens a chunk
    batch = batches(model.config.vocab_size)["padded"]
    with torch.no_grad():
        predicted = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    # Every third trained label becomes the model's own prediction: a count that is neither 0 nor all
    labels = batch["labels"].clone()
    chosen = torch.zeros_like(labels[:, 1:], dtype=torch.bool)
    chosen[:, ::3] = True
    labels[:, 1:] = torch.where(chosen & (labels[:, 1:] != -100), predicted[:, :-1], labels[:, 1:])
    batch = {**batch, "labels": labels}
    trained = labels[:, 1:] != -100
    want = int(((predicted[:, :-1] == labels[:, 1:]) & trained).sum())
    assert 0 < want < int(trained.sum())
    value, count, correct = chunked.token_loss_and_correct(model, batch, CPU)
    value.backward()
    assert (int(correct), count) == (want, int(trained.sum()))
    assert float(value) == pytest.approx(float(reference_loss_sum(model, batch, CPU)[0]), rel=1e-5)
    with torch.no_grad():
        assert int(chunked.token_loss_and_correct(model, batch, CPU)[2]) == want


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_token_logps_at_a_temperature_are_a_plain_log_softmax_of_the_scaled_logits(tiny_llama, monkeypatch, temperature):
    """GRPO scores its completions at the sampling temperature: the chunked head's log-probs (several chunks) and
    their gradient equal log_softmax(full logits / T) at the trained positions, gathered at the next tokens."""
    model = lora_model(tiny_llama)
    monkeypatch.setattr(chunked, "CHUNK_LOGIT_ELEMENTS", model.config.vocab_size * 16)  # 16 tokens a chunk
    batch = batches(model.config.vocab_size)["padded"]

    def plain(model, batch, device):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        logps = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
        labels = batch["labels"][:, 1:]
        trained = labels != -100
        return logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)[trained]

    values = {}
    for name, function in (("plain", plain), ("ours", lambda m, b, d: chunked.token_logps(m, b, d, temperature=temperature))):
        model.zero_grad(set_to_none=True)
        logps = function(model, batch, CPU)
        (logps * torch.linspace(-1, 1, logps.numel())).sum().backward()  # a weighted sum: every position's gradient
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        values[name] = (logps.detach(), grads)
    (want, want_grads), (got, got_grads) = values["plain"], values["ours"]
    assert got.shape == want.shape and want.numel() == int((batch["labels"][:, 1:] != -100).sum())
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert len(got_grads) == len(want_grads) > 0
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(got_grads, want_grads))


@pytest.mark.parametrize("grad", [True, False])
def test_the_entropy_beside_the_log_probs_is_that_of_the_full_tempered_distribution(tiny_llama, monkeypatch, grad):
    """GRPO's `entropy` metric (TRL's): the chunked head (several chunks; with the graph, and without as in a no-grad
    forward) adds up the entropy of softmax(full logits / T) over the trained positions."""
    model = lora_model(tiny_llama)
    monkeypatch.setattr(chunked, "CHUNK_LOGIT_ELEMENTS", model.config.vocab_size * 16)  # 16 tokens a chunk
    batch = batches(model.config.vocab_size)["padded"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    logp = F.log_softmax(logits[:, :-1].float() / 0.7, dim=-1)
    trained = batch["labels"][:, 1:] != -100
    want = float(-(logp.exp() * logp).sum(-1)[trained].sum())
    pieces: list[torch.Tensor] = []
    with torch.set_grad_enabled(grad):
        chunked.token_logps(model, batch, CPU, temperature=0.7, entropy=pieces)
    assert len(pieces) > 1 and float(sum(pieces)) == pytest.approx(want, rel=1e-5)


def test_head_unchanged_outside_the_loss(tiny_llama):
    model = lora_model(tiny_llama)
    ids = batches(model.config.vocab_size)["padded"]["input_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).logits
        chunked.token_loss_sum(model, batches(model.config.vocab_size)["padded"], CPU)
        after = model(input_ids=ids).logits
    assert after.shape == (3, 48, model.config.vocab_size)
    assert torch.equal(before, after)


def test_no_trained_token_still_backpropagates(tiny_llama):
    model = lora_model(tiny_llama)
    batch = batches(model.config.vocab_size)["padded"]
    batch["labels"] = torch.full_like(batch["labels"], -100)
    value, count = chunked.token_loss_sum(model, batch, CPU)
    value.backward()  # every rank must run a backward through every FSDP unit, even with nothing to learn
    assert count == 0 and float(value) == 0.0
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_trainable_head_gets_its_gradient(tiny_llama):
    model = lora_model(tiny_llama, trainable_head=True)
    diff = compare(model, batches(model.config.vocab_size)["padded"])
    assert diff["loss"] < 1e-5 and diff["grad"] < 1e-4, diff
    assert model.get_output_embeddings().weight.grad is not None


def test_final_logit_softcapping():
    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma2", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, final_logit_softcapping=5.0)
    model = lora_model(None, family_config=config)
    diff = compare(model, batches(300)["padded"])
    assert diff["loss"] < 1e-5 and diff["grad"] < 1e-4, diff
    assert model.config.final_logit_softcapping == 5.0  # restored after the forward


def test_text_rows_without_bos_are_averaged_over_their_targets_only(tiny_qwen2, tmp_path):
    """Found by a bug bash (mutation testing, bb50 S4): counting `labels != -100` (the row's first token too) in place
    of `labels[:, 1:]` in the SFT objective's token count passed every test: chat, completion and pair rows never
    train their first token, but a text row under a tokenizer that puts no BOS first (Qwen's) labels it, though nothing
    predicts it. The step's count is then tokens - rows, and the logged loss transformers' own `labels=` loss of each
    row, weighted by its targets (what F.cross_entropy over the unpacked, right-padded batch gives too)."""
    from conftest import write_jsonl

    from finetune import data, model
    from finetune.recipe import validate_recipe
    from finetune.training import objectives

    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "line " + "of the text " * i} for i in range(1, 4)])
    recipe = validate_recipe({"model": {"name_or_path": str(tiny_qwen2), "dtype": "float32"}, "lora": {"dropout": 0.0},
                              "data": {"datasets": [{"path": str(path), "format": "text"}], "max_length": 64,
                                       "eval_fraction": 0.0, "cache": False}})
    tokenizer = model.load_tokenizer(recipe)
    examples = data.prepare(recipe, tokenizer).train
    lengths = [len(e.input_ids) for e in examples]
    assert tokenizer.bos_token is None and len(set(lengths)) == 3 and all(-100 not in e.labels for e in examples)
    batch = data.collate(list(examples), tokenizer.pad_token_id)
    peft_model = model.build_model(recipe, device=CPU, gradient_checkpointing=False)
    objective = objectives.for_recipe(peft_model, recipe, tokenizer)
    totals = objective.counts(peft_model, [batch], CPU)
    assert totals == [sum(lengths) - 3]  # every token a target but each row's first
    _, summed, _ = objective.loss(peft_model, batch, totals, CPU)
    logged = objective.step_loss(float(summed), totals)
    with torch.no_grad():
        rows = [float(peft_model(input_ids=torch.tensor([e.input_ids]), labels=torch.tensor([e.labels])).loss)
                for e in examples]
        logits = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    by_rows = sum(loss * (length - 1) for loss, length in zip(rows, lengths)) / (sum(lengths) - 3)
    plain = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
    assert logged == pytest.approx(by_rows, rel=1e-5) and logged == pytest.approx(float(plain), rel=1e-5)


STRATEGIES = [("ddp", 2, False), ("fsdp", 1, False), ("fsdp", 2, False), ("fsdp", 2, True)]


def worker(model_dir: str) -> None:
    """One rank: for each wrapper, build the 4-bit model as run.py does, wrap it, compare both losses on own data."""
    from finetune import distributed, parallel
    from finetune import model as models
    from finetune.recipe import validate_recipe

    info = distributed.init_distributed()
    recipe = validate_recipe({"model": {"name_or_path": model_dir, "dtype": "float32"}, "lora": {"dropout": 0.0},
                              "data": {"datasets": [{"path": "unused.jsonl"}]}})
    report = {}
    for strategy, version, checkpointing in STRATEGIES:
        distributed.seed_everything(0)
        peft_model = models.build_model(recipe, device=info.device, gradient_checkpointing=checkpointing)
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02)
        plan = parallel.ParallelPlan(strategy=strategy, world_size=info.world_size, fsdp_version=version,
                                     layer_class="LlamaDecoderLayer", activation_checkpointing=checkpointing,
                                     param_dtype=torch.float32)
        wrapped = parallel.wrap(peft_model, plan, info)
        for kind, batch in batches(peft_model.config.vocab_size, seed=1 + info.rank).items():
            report[f"{plan.describe()}{' + checkpointing' if checkpointing else ''} / {kind}"] = compare(wrapped, batch)
    if info.is_main:
        print("REPORT " + json.dumps(report))
    distributed.teardown()


@pytest.mark.slow
def test_equal_under_ddp_fsdp1_fsdp2_two_processes(tiny_llama):
    from conftest import child_env, free_port, run_cmd

    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
            __file__, str(tiny_llama)]
    result = run_cmd(args, env=child_env(), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))[7:])
    assert len(report) == 2 * len(STRATEGIES)
    for where, diff in report.items():
        assert diff["loss"] < 1e-5 and diff["eval"] < 1e-5 and diff["grad"] < 1e-4, (where, diff)


if __name__ != "__main__":  # the torchrun worker (this file as a script) has only the repository on its path
    from host_syncs import HostSyncs
else:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    worker(sys.argv[1])
