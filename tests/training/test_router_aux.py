"""A mixture-of-experts model's router load-balancing loss (train.router_aux_loss_coef), added as TRL 1.16 adds it.

Found by a bug bash (bb11, finding 3): finetune's loss was the cross-entropy alone, on every MoE model, while TRL's
SFTTrainer (and its DPO, KTO and GRPO trainers) add router_aux_loss_coef x the model's aux_loss by default, with the
model config's coefficient; the recipe key was refused with a message saying finetune set it itself. Routers trained
with lora.train_router had no balancing term (an expert of tiny Mixtral received no token after 40 steps).

The oracle of the SFT step is TRL's own code: `SFTTrainer.compute_loss` as it ships (on a trainer made without its
__init__, its attributes set as __init__ sets them, as tests/training/test_preference_oracle.py does), fed by a plain
transformers Mixtral with TRL's fused LM head (`add_fused_lm_head`) and PEFT's LoRA, holding the same weights as
finetune's model; the micro-batches are the ones finetune's loop trained on.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from conftest import read_metrics, recipe_dict

from finetune import data, distributed, model, training
from finetune.data import Example, collate, concat_examples
from finetune.errors import RecipeError
from finetune.recipe import validate_recipe
from finetune.training import loop
from finetune.training.loss import token_loss_and_correct
from finetune.training.objectives import Supervised
from finetune.training.router_aux import real_tokens

CPU = torch.device("cpu")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _trl_sft(peft_oracle, *, coef: float, accumulation: int):
    """SFTTrainer without __init__: the attributes compute_loss reads, as __init__ sets them from SFTConfig (one
    process, no tensor or sequence parallelism, loss_type nll, average_tokens_across_devices: the default)."""
    from trl import SFTTrainer

    trainer = object.__new__(SFTTrainer)
    trainer.model = peft_oracle
    trainer.args = SimpleNamespace(loss_type="nll", average_tokens_across_devices=True, label_smoothing_factor=0.0)
    trainer.accelerator = SimpleNamespace(num_processes=1, parallelism_config=None, gather_for_metrics=lambda t: t)
    trainer.is_deepspeed_enabled = False
    trainer.compute_loss_func, trainer.label_smoother = None, None
    text_config = peft_oracle.config.get_text_config()
    trainer.router_aux_loss_coef = coef  # SFTConfig.router_aux_loss_coef given
    trainer.aux_loss_enabled = hasattr(text_config, "output_router_logits") and coef != 0.0
    text_config.output_router_logits, text_config.router_aux_loss_coef = trainer.aux_loss_enabled, coef
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._total_train_tokens, trainer._tp_size = 0, 1
    trainer.current_gradient_accumulation_steps = accumulation
    return trainer


def _trl_step(tiny_mixtral, start: dict, micro_batches: list[dict], *, coef: float, train_router: bool):
    """(gradients, logged loss, logged aux_loss) of TRL's step: compute_loss per micro-batch, num_items_in_batch the
    step's trained tokens (Trainer counts labels[..., 1:]), each loss backpropagated as returned (Trainer divides no
    further: the loss is scaled for accumulation by num_items_in_batch, and TRL divides the aux term itself)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    plain = AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32)
    add_fused_lm_head(plain, outputs=("log_probs", "entropy", "is_top1"))  # before PEFT, as TRL says
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=ATTENTION,
                        modules_to_save=["gate"] if train_router else None)
    oracle = get_peft_model(plain, config)
    missing = oracle.load_state_dict(start, strict=False)
    assert not missing.unexpected_keys and not [k for k in missing.missing_keys if "lora_" in k or "modules_to_save" in k]
    oracle.train()
    trainer = _trl_sft(oracle, coef=coef, accumulation=len(micro_batches))
    items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)
    logged = 0.0
    for batch in micro_batches:
        loss = trainer.compute_loss(oracle, dict(batch), num_items_in_batch=torch.tensor(items))
        loss.backward()
        logged += float(loss.detach())
    grads = {name: p.grad.clone() for name, p in oracle.named_parameters() if p.grad is not None}
    aux = trainer._metrics["train"].get("aux_loss", [])
    return grads, logged, sum(aux) / len(aux) if aux else None


def _finetune_step(tiny_mixtral, alpaca_file, out, monkeypatch, *, coef, train_router: bool):
    """(starting trainable state, the step's micro-batches, its gradients, its metrics line) of finetune's loop: one
    step of 2 micro-batches, gradient checkpointing on, LoRA B drawn at random so every LoRA tensor gets a gradient."""
    recipe = validate_recipe(recipe_dict(
        tiny_mixtral, alpaca_file, out, quantization={"method": "none"},
        lora={"target_modules": ATTENTION, "train_router": train_router},
        train={"max_steps": 1, "micro_batch_size": 2, "grad_accum": 2, "eval_every": 0, "save_every": 0,
               "router_aux_loss_coef": coef}, data={"eval_fraction": 0.0}))
    distributed.init_distributed()
    tokenizer = model.load_tokenizer(recipe)
    train_examples, _, _ = data.build_examples(recipe, tokenizer)
    peft_model = model.build_model(recipe, device=CPU, gradient_checkpointing=True)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(7)
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    start = {name: p.detach().clone() for name, p in peft_model.named_parameters() if p.requires_grad}
    taken, grads = [], {}
    take, step = Supervised.take, loop.optimizer_step

    def record(self, *args):
        micro_batches = take(self, *args)
        taken.extend(copy.deepcopy(micro_batches))
        return micro_batches

    monkeypatch.setattr(Supervised, "take", record)

    def optimizer_step(model_, optimizer, parameters, max_grad_norm, **kw):
        grads.update({n: p.grad.clone() for n, p in peft_model.named_parameters() if p.grad is not None})
        return step(model_, optimizer, parameters, max_grad_norm, **kw)

    monkeypatch.setattr(loop, "optimizer_step", optimizer_step)
    out.mkdir(parents=True)
    training.train(peft_model, recipe, train_examples, [], pad_id=tokenizer.pad_token_id, out_dir=out)
    return start, taken, grads, next(m for m in read_metrics(out) if "loss" in m)


@pytest.mark.parametrize("train_router", [True, False], ids=["routers-trained", "routers-frozen"])
def test_the_sft_step_adds_the_load_balancing_loss_as_trls_sft_trainer(tiny_mixtral, alpaca_file, tmp_path,
                                                                        monkeypatch, train_router):
    """Found by a bug bash: the loss had no load-balancing term and train.router_aux_loss_coef was refused. Now the
    gradient of a step of 2 accumulated micro-batches (gradient checkpointing on) equals TRL's SFTTrainer's: CE summed
    over the global trained tokens + coef x each micro-batch's aux_loss / the accumulation steps; the logged loss is
    TRL's (the load-balancing term included) and `aux_loss` the mean of the micro-batches' (TRL's metric)."""
    coef = 0.5  # large, so that a wrong weight of the term shows far above the tolerance
    start, micro_batches, grads, logged = _finetune_step(tiny_mixtral, alpaca_file, tmp_path / "run", monkeypatch,
                                                         coef=coef, train_router=train_router)
    assert len(micro_batches) == 2 and all("attention_mask" in b for b in micro_batches)
    expected, trl_loss, trl_aux = _trl_step(tiny_mixtral, start, micro_batches, coef=coef, train_router=train_router)
    without, _, _ = _trl_step(tiny_mixtral, start, micro_batches, coef=0.0, train_router=train_router)
    assert set(grads) == set(expected) and len(grads) >= 16
    for name, grad in grads.items():
        scale = expected[name].abs().max()
        assert (grad - expected[name]).abs().max() <= 1e-4 * scale + 1e-7, name
    # the test can fail: the term moves the gradients far more than the tolerance
    moved = max(float((expected[n] - without[n]).abs().max() / expected[n].abs().max()) for n in expected)
    assert moved > 1e-2, moved
    assert logged["aux_loss"] == pytest.approx(trl_aux, abs=2e-6)
    assert logged["loss"] == pytest.approx(trl_loss, abs=2e-5)


def test_packed_rows_leave_their_padding_tails_out(tiny_mixtral):
    """Packed rows carry no attention mask, so the model's own aux_loss counted each row's padding tail as tokens.
    The loss of a packed batch equals the model's own over the same examples batched with padding (attention mask),
    as TRL's padding-free batches (no padding at all) have it; the model's loss over the whole packed rows differs.
    The run's model is inside PEFT's wrapper: its transformers class is the one whose loss function is used.
    Found by a bug bash (mutant RA2): no row ended with a trained pad id (pad == EOS), so a mask that dropped every pad
    id, trained or not, passed; one example now ends so and must count."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(3)
    lengths = [[9, 6], [4], [7, 3]]
    pad = 0

    def example(n):
        ids = torch.randint(5, 200, (n,), generator=generator).tolist()
        return Example(ids, ids)

    rows = [[example(n) for n in row] for row in lengths]
    ends = rows[2][1].input_ids[:-1] + [pad]  # a row's last example ends with a trained pad id (pad == EOS) just
    rows[2][1] = Example(ends, list(ends))  # before the row's padding tail: a real token
    packed = collate([concat_examples(row) for row in rows], pad)
    assert "position_ids" in packed and (packed["input_ids"] == pad).sum() > 10  # padding tails
    plain = AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32).eval()
    wrapped = get_peft_model(plain, LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))  # as the run's
    router_aux = Supervised(wrapped, _objective_recipe()).router_aux  # the config's 0.001
    assert router_aux.enabled
    router_aux.pad_id = pad
    router_aux.begin_step(1)
    with torch.no_grad():
        token_loss_and_correct(wrapped, packed, CPU, router_aux=router_aux)
        ours = router_aux._pending[0]
        padded = collate([e for row in rows for e in row], pad)
        reference = wrapped(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                          output_router_logits=True).aux_loss
        whole_rows = wrapped(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                           output_router_logits=True).aux_loss
    assert float(ours) == pytest.approx(float(reference), abs=1e-5)
    assert abs(float(whole_rows) - float(reference)) > 1e-3
    mask = real_tokens(packed["input_ids"], packed["labels"], pad)
    assert mask.sum(dim=1).tolist() == [sum(row) for row in lengths]


def _tiny_moe(model_type: str = "mixtral", **fields):
    """A 1-layer MoE causal LM built from its config in the test (random weights, no files)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 1, "vocab_size": 64, "num_experts_per_tok": 2}
    sizes.update({"num_local_experts": 4} if model_type == "mixtral" else {"num_experts": 4})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes, **fields)).float()


def _objective_recipe(objective: str = "sft", *, dpo: dict | None = None, **train):
    data_format = {"sft": "alpaca", "dpo": "preference", "kto": "unpaired_preference", "reward": "preference"}[objective]
    raw = {"model": {"name_or_path": "tiny"}, "data": {"datasets": [{"path": "d.jsonl", "format": data_format}]},
           "train": {"objective": objective, **train}}
    return validate_recipe({**raw, **({"dpo": dpo} if dpo else {})})


@pytest.mark.parametrize(("objective", "extra", "coef"), [
    ("sft", {}, 0.001),  # the model config's, as TRL's SFTTrainer
    ("sft", {"router_aux_loss_coef": 0.0}, 0.0),  # off
    ("sft", {"router_aux_loss_coef": 0.05}, 0.05),
    ("dpo", {}, 0.001),  # DPOTrainer: on by default
    ("dpo", {"dpo": {"loss": "orpo"}}, 0.0),  # ORPOTrainer: only with the config's output_router_logits
    ("dpo", {"dpo": {"loss": "simpo"}, "router_aux_loss_coef": 0.05}, 0.05),
    ("kto", {}, 0.001),
    ("reward", {}, 0.0),  # RewardTrainer adds none
])
def test_each_objective_weights_the_loss_as_its_trl_trainer(objective, extra, coef):
    """Found by a bug bash: no objective added the load-balancing loss. Now each does what its TRL 1.16 trainer does
    with the recipe's weight, or unset, by default (tiny Mixtral, whose config declares 0.001)."""
    from finetune.training import objectives

    recipe = _objective_recipe(objective, **extra)
    found = objectives.objective_class(recipe)(_tiny_moe(), recipe).router_aux
    assert found.coef == coef
    assert (found.describe() is not None) == (coef != 0)


def test_orpo_adds_it_where_the_model_config_asks_for_router_logits():
    from finetune.training import objectives

    recipe = _objective_recipe("dpo", dpo={"loss": "orpo"})
    moe = _tiny_moe(output_router_logits=True, router_aux_loss_coef=0.02)
    assert objectives.objective_class(recipe)(moe, recipe).router_aux.coef == 0.02


def test_a_model_without_the_loss_is_refused_at_the_run_and_left_off_by_default():
    """A weight for a dense model (or DeepSeek-V3 / Llama 4, whose classes compute no such loss) is refused in one
    paragraph when the objective is built; unset, the run adds nothing (TRL's SFTTrainer would crash on Llama 4,
    whose config declares router_aux_loss_coef but whose forward returns aux_loss None)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64))
    with pytest.raises(RecipeError, match=r"^train\.router_aux_loss_coef \(0\.02\): LlamaForCausalLM \(llama\) is not"):
        Supervised(llama, _objective_recipe(router_aux_loss_coef=0.02))
    assert not Supervised(llama, _objective_recipe()).router_aux.enabled
    # the run's model: inside PEFT's wrapper, whose own class is no transformers model's
    llama4 = get_peft_model(_tiny_moe("llama4_text", intermediate_size_mlp=32),
                            LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert llama4.config.router_aux_loss_coef == 0.001 and not Supervised(llama4, _objective_recipe()).router_aux.enabled
    with pytest.raises(RecipeError, match="returns no load-balancing loss"):
        Supervised(llama4, _objective_recipe(router_aux_loss_coef=0.02))


def test_dpo_takes_the_loss_of_the_policy_forward_of_both_sequences_not_the_references():
    """As TRL's DPOTrainer: the policy's one forward of the chosen and rejected sequences together gives the
    load-balancing loss; the reference forward (here the adapter off) asks for no router logits."""
    from finetune.training import objectives

    moe = _tiny_moe()
    recipe = _objective_recipe("dpo", router_aux_loss_coef=0.5)
    objective = objectives.objective_class(recipe)(moe, recipe)
    generator = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, 64, (n,), generator=generator).tolist()
    pairs = [(ids(4), ids(3), ids(5)), (ids(2), ids(6), ids(2))]
    batch = collate([Example(p + c, [-100] * len(p) + c, rejected=Example(p + r, [-100] * len(p) + r))
                     for p, c, r in pairs], 0)
    objective.router_aux.begin_step(2)
    to_backward, _, _ = objective.loss(moe, batch, [2, 9], CPU)
    assert len(objective.router_aux._pending) == 1  # the policy's forward only
    with torch.no_grad():
        expected = moe(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       output_router_logits=True).aux_loss
    assert float(objective.router_aux._pending[0].detach()) == pytest.approx(float(expected), abs=1e-6)
    total = objective.router_aux.added_to(to_backward)
    assert float((total - to_backward).detach()) == pytest.approx(0.5 * float(expected) / 2, abs=1e-6)
    assert objective.router_aux.step_sums(CPU)[1] == 1
