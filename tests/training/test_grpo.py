"""GRPO (train.objective: grpo): the recipe and its errors, prompt data, reward functions, sampling, and real runs.

* Recipe: TRL's GRPOConfig names and defaults; every mistake of a GRPO recipe named at once, with the fix.
* Data: text and chat prompts (the chat template's generation prompt added), the other columns kept for the reward
  functions; no prompt column, and a prompt over the budget, each one paragraph naming the row and the fix.
* Rewards: TRL's signature and nansum; a raising function named with the prompt's row and the exception.
* Sampling: near-zero temperature is greedy decoding (the KV cache and left padding against transformers' generate);
  a completion depends only on its seed (prompt row, step, number in the group), never on the batch's other rows;
  nucleus filtering draws only from the nucleus.
The loss itself is checked against TRL's in test_grpo_oracle.py; the runs in test_grpo_runs.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import recipe_dict, write_jsonl

from finetune import data, model
from finetune.data import IGNORE_INDEX
from finetune.errors import DataError, RecipeError, RewardError
from finetune.recipe import GRPOSection, validate_recipe
from finetune.training.objectives.grpo import loss as grpo
from finetune.training.objectives.grpo import rewards as grpo_rewards
from finetune.training.objectives.grpo import sampling as rollout

CPU = torch.device("cpu")
REWARD = "finetune.rewards:exact_match"


def sums(n: int = 24, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)}
            for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(n))]


def grpo_recipe(model_dir, data_file, out_dir, grpo_keys: dict | None = None, **sections) -> dict:
    values = recipe_dict(model_dir, data_file, out_dir, **sections)
    values["data"]["datasets"][0]["format"] = "prompt"
    values["train"].setdefault("objective", "grpo")
    values["train"]["objective"] = "grpo"
    values["train"].setdefault("micro_batch_size", 4)
    values["grpo"] = {"num_generations": 4, "max_completion_length": 8, "reward_functions": [REWARD],
                      **(grpo_keys or {})}
    return values


def _refused(values) -> str:
    with pytest.raises(RecipeError) as caught:
        validate_recipe(values)
    return str(caught.value)


# ---------------------------------------------------------------------------------------------------------- recipe
def test_defaults_are_trls_grpo_config():
    from trl import GRPOConfig

    ours, fields = GRPOSection(), GRPOConfig.__dataclass_fields__  # the declared defaults (no TrainingArguments checks)
    for name in ("num_generations", "max_completion_length", "temperature", "top_p", "num_iterations", "epsilon",
                 "epsilon_high", "beta", "loss_type", "scale_rewards", "mask_truncated_completions", "reward_weights"):
        assert getattr(ours, name) == fields[name].default, name
    assert ours.upper_epsilon == ours.epsilon  # TRL's __post_init__: epsilon_high None -> epsilon


def test_every_grpo_mistake_is_named_at_once_with_its_fix(tmp_path):
    values = grpo_recipe(tmp_path, tmp_path / "p.jsonl", tmp_path / "out",
                         {"num_generations": 3, "max_completion_length": 200, "reward_weights": [1.0, 2.0],
                          "reward_functions": [REWARD, "no_such_module:f", "finetune.rewards", "finetune.rewards:re"]})
    message = _refused(values)
    for part in ("grpo.reward_functions[1]: `no_such_module:f` cannot be imported (ModuleNotFoundError",
                 "grpo.reward_functions[2]: `finetune.rewards` is not `module:function`",
                 # named with its fix (the message was an f-string inside a comment: a bare ValueError)
                 "grpo.reward_functions[3]: `finetune.rewards:re` is a module, not a function. Fix: name a function",
                 "grpo.reward_weights: 2 weights for 4 reward functions",
                 "train.micro_batch_size (4) is not a multiple of grpo.num_generations (3)",
                 "grpo.max_completion_length (200) leaves no prompt budget within data.max_length (128)"):
        assert part in message, message
    assert "\n" not in message.split("problem in the recipe:")[1].strip()  # one paragraph


def test_grpo_keys_and_data_go_with_the_objective(tmp_path):
    values = grpo_recipe(tmp_path, tmp_path / "p.jsonl", tmp_path / "out")
    values["data"]["datasets"][0]["format"] = "alpaca"
    assert "has format `alpaca`, but train.objective is grpo" in _refused(values)
    values = grpo_recipe(tmp_path, tmp_path / "p.jsonl", tmp_path / "out")
    values["train"]["objective"] = "sft"
    assert "has format `prompt` (prompt data), but train.objective is sft" in _refused(values)
    values = recipe_dict(tmp_path, tmp_path / "a.jsonl", tmp_path / "out", grpo={"beta": 0.1})
    assert "grpo.beta: set, but train.objective is sft" in _refused(values)
    values = grpo_recipe(tmp_path, tmp_path / "p.jsonl", tmp_path / "out", {"num_iterations": 2},
                         train={"save_every": 3})
    assert "train.save_every (3) is not a multiple of grpo.num_iterations (2)" in _refused(values)
    values = grpo_recipe(tmp_path, tmp_path / "p.jsonl", tmp_path / "out", {"scale_rewards": False})
    assert validate_recipe(values).grpo.scale_rewards == "none"  # TRL's bool form


# ------------------------------------------------------------------------------------------------------------ data
def _prompts(tiny_llama, rows, tmp_path, **keys):
    values = grpo_recipe(tiny_llama, write_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "out", keys.pop("grpo", {}))
    values["data"].update(keys)
    recipe = validate_recipe(values)
    tokenizer = model.load_tokenizer(recipe)
    return data.prompt_examples(recipe, tokenizer), tokenizer


def test_text_and_chat_prompts_keep_their_columns_for_the_rewards(tiny_llama, tmp_path):
    chat = [{"role": "user", "content": "What is 1 plus 1?"}]
    rows = [{"prompt": "What is 2 plus 3?", "answer": "5"}, {"prompt": chat, "answer": "2", "level": 1}]
    (train, evaluation, stats), tokenizer = _prompts(tiny_llama, rows, tmp_path)
    assert evaluation == [] and stats.train_examples == 2
    assert tokenizer.decode(train[0].input_ids) == "What is 2 plus 3?"
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(train[1].input_ids) == rendered and rendered.rstrip().endswith("assistant")
    assert all(label == IGNORE_INDEX for e in train for label in e.labels)
    assert [e.row for e in train] == [rows[0], rows[1]] and [e.prompt_index for e in train] == [0, 1]
    batch = data.collate(list(train), pad_id=0)
    assert batch["rows"] == rows and batch["prompt_index"].tolist() == [0, 1]


def test_every_rows_columns_reach_the_rewards_and_a_column_named_as_an_argument_is_refused(tiny_llama, tmp_path):
    """A column only later rows have reaches the reward functions (None where a row lacks it: the first row's keys
    were all that was passed); a column named `completions` (or `prompts`, `completion_ids`) would collide with the
    call's own argument, and is refused when the data is read, naming it (the last three: TRL 1.16's extra arguments,
    which finetune passes too: a column of their name was replaced silently)."""
    from finetune.training.objectives.grpo.rollouts import reward_columns

    rows = [{"prompt": "a", "answer": "5"}, {"prompt": "b", "answer": "2", "level": 1}]
    assert reward_columns(rows) == {"answer": ["5", "2"], "level": [None, 1]}
    for name in ("completions", "prompts", "completion_ids", "trainer_state", "log_metric", "log_extra"):
        with pytest.raises(DataError, match=f"a column named `{name}`, which the reward functions receive as their own "
                                            "argument.*Fix: rename the column"):
            _prompts(tiny_llama, [{"prompt": "a", "answer": "5"}, {"prompt": "b", name: "x"}], tmp_path)


def test_no_prompt_column_and_an_overlong_prompt_are_one_paragraph_each(tiny_llama, tmp_path):
    with pytest.raises(DataError, match=r"the rows have no `prompt` column \(columns: question, answer\).*Fix: give "
                       r"each row a `prompt`.*columns: \{prompt: NAME\}"):
        _prompts(tiny_llama, [{"question": "Hi", "answer": "1"}], tmp_path)
    rows = [{"prompt": "short", "answer": "1"}, {"prompt": "long " * 60, "answer": "2"}]
    with pytest.raises(DataError, match=r"row 2: the prompt is \d+ tokens, over the prompt budget of 120 \(data.max_length "
                       r"128 - grpo.max_completion_length 8\)\. Fix: .*data.overlong: drop"):
        _prompts(tiny_llama, rows, tmp_path)
    (train, _, stats), _ = _prompts(tiny_llama, rows, tmp_path, overlong="drop")
    assert len(train) == 1 and stats.dropped == 1 and "row 2" in stats.dropped_rows[0]


# --------------------------------------------------------------------------------------------------------- rewards
def test_builtin_rewards_and_the_weighted_nansum():
    from finetune import rewards

    chat = [[{"role": "assistant", "content": " 5 "}], [{"role": "assistant", "content": "6"}]]
    assert rewards.exact_match(["q", "q"], chat, answer=["5", "5"]) == [1.0, 0.0]
    assert rewards.exact_match(["q"], ["5"], answer=[None]) == [None]
    assert rewards.regex_match(["q"] * 2, ["<a>1</a>", "1"], pattern=[r"<a>\d+</a>"] * 2) == [1.0, 0.0]
    assert rewards.length_penalty(["q"], ["abcd"]) == [-0.004]
    with pytest.raises(ValueError, match="`answer` column"):
        rewards.exact_match(["q"], ["5"])
    table = grpo_rewards.rewards_per_function([rewards.exact_match, lambda prompts, completions, **kw: [0.5, 0.25, None]],
                                      ["q"] * 3, ["5", "7", "8"], {"answer": ["5", None, None]}, ["row 4"] * 3)
    assert table[0].tolist() == [1.0, 0.5] and torch.isnan(table[1, 0]) and table[1, 1] == 0.25
    weighted = grpo_rewards.weighted_rewards(table, [2.0, 1.0])  # None skipped (nansum); none scored at all: NaN
    assert weighted[:2].tolist() == [2.5, 0.25] and torch.isnan(weighted[2])


def test_a_raising_reward_names_itself_the_prompt_row_and_the_exception():
    def strict(prompts, completions, answer, **columns):
        return [float(int(c) == int(a)) for c, a in zip(completions, answer)]

    places = ["prompt row 8 of p.jsonl (data.datasets[0])"] * 2 + ["prompt row 9 of p.jsonl (data.datasets[0])"] * 2
    with pytest.raises(RewardError) as caught:
        grpo_rewards.rewards_per_function([strict], ["q"] * 4, ["5", "5", "x", "1"], {"answer": ["5"] * 4}, places)
    message = str(caught.value)
    assert ("`strict` raised ValueError: invalid literal for int() with base 10: 'x' (on prompt row 9 of p.jsonl "
            "(data.datasets[0]))") in message
    assert "checkpoints it wrote are intact" in message and "train.resume=auto" in message and "\n" not in message
    with pytest.raises(RewardError, match="returned 1 values for 2 completions"):
        grpo_rewards.rewards_per_function([lambda prompts, completions, **kw: [1.0]], ["q"] * 2, ["a", "b"], {}, ["r"] * 2)
    with pytest.raises(RewardError, match=r"returned '1.0' for the completion of prompt row 1 of p.jsonl\. Fix: return"):
        grpo_rewards.rewards_per_function([lambda prompts, completions, **kw: ["1.0"]], ["q"], ["a"], {},
                                          ["prompt row 1 of p.jsonl"])


def test_rewards_as_numpy_scalars_and_one_element_tensors_are_numbers_as_in_trl():
    """TRL makes a float tensor of what a reward function returns: numpy scalars, 0-d and one-element tensors and
    arrays, bools are numbers there; they were refused here."""
    import numpy as np

    values = [np.float32(0.5), np.float64(0.25), torch.tensor(2.0), torch.tensor([3.0]), np.array(4.0), True, None]
    table = grpo_rewards.rewards_per_function([lambda prompts, completions, **kw: values], ["q"] * 7, list("abcdefg"),
                                              {}, [0] * 7)
    assert table[:6, 0].tolist() == [0.5, 0.25, 2.0, 3.0, 4.0, 1.0] and torch.isnan(table[6, 0])
    with pytest.raises(RewardError, match="returned tensor"):  # more than one value for one completion
        grpo_rewards.rewards_per_function([lambda prompts, completions, **kw: [torch.ones(2)]], ["q"], ["a"], {}, [0])


# -------------------------------------------------------------------------------------------------------- sampling
def test_sampling_draws_only_from_the_nucleus_at_the_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4000))
    generators = [torch.Generator().manual_seed(i) for i in range(4000)]
    drawn = rollout.sample_tokens(logits, generators, temperature=1.0, top_p=0.7)
    counts = torch.bincount(drawn, minlength=4) / 4000
    assert counts[2:].sum() == 0 and counts[0] == pytest.approx(0.625, abs=0.03)  # 0.5 / 0.8 of the nucleus
    generators = [torch.Generator().manual_seed(i) for i in range(4000)]
    hot = torch.bincount(rollout.sample_tokens(logits, generators, temperature=2.0, top_p=1.0), minlength=4) / 4000
    flat = torch.softmax(logits[0] / 2.0, dim=-1)
    assert hot.tolist() == pytest.approx(flat.tolist(), abs=0.03)


def test_sampling_at_top_p_1_sorts_nothing(monkeypatch):
    """No nucleus, no sort of the vocabulary (it ran at every decoding step, in float64: a cost at 150k tokens on a
    GPU); the draws still follow the probabilities."""
    logits = torch.log(torch.tensor([[0.05, 0.15, 0.3, 0.5]] * 4000))

    def no_sort(*args, **kwargs):
        raise AssertionError("the vocabulary was sorted at top_p 1")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    monkeypatch.setattr(torch, "sort", no_sort)
    generators = [torch.Generator().manual_seed(i) for i in range(4000)]
    counts = torch.bincount(rollout.sample_tokens(logits, generators, temperature=1.0, top_p=1.0), minlength=4) / 4000
    assert counts.tolist() == pytest.approx([0.05, 0.15, 0.3, 0.5], abs=0.03)


@pytest.fixture(scope="module")
def policy(tiny_llama):
    recipe = validate_recipe(grpo_recipe(tiny_llama, "unused.jsonl", "unused"))
    loaded = model.load_model(recipe, sharded=False, device=CPU, device_map=None, gradient_checkpointing=False)
    return loaded.model, model.load_tokenizer(recipe)


@pytest.mark.slow  # ~5 s: two tiny-model generations
def test_near_zero_temperature_is_transformers_greedy_generate(policy):
    """KV cache, left padding and positions against transformers' own generate (greedy) on prompts of 3 lengths."""
    peft_model, tokenizer = policy
    prompts = [tokenizer(text)["input_ids"] for text in ("Hi", "What is 2 plus 3?", "Name a colour please")]
    ours = rollout.generate_completions(peft_model, prompts, [0, 1, 2], max_new_tokens=6, temperature=1e-6, top_p=1.0,
                                        eos_ids=[tokenizer.eos_token_id], pad_id=tokenizer.pad_token_id, device=CPU)
    for prompt, completion in zip(prompts, ours):
        ids = torch.tensor([prompt])
        expected = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                       do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                       eos_token_id=tokenizer.eos_token_id)[0, len(prompt):].tolist()
        cut = next((i + 1 for i, t in enumerate(expected) if t == tokenizer.eos_token_id), len(expected))
        assert completion == expected[:cut]


@pytest.mark.slow
def test_a_completion_depends_on_its_seed_not_on_the_other_rows(policy):
    """The shared sampling that makes runs comparable across world sizes: a row sampled with its batch, alone, or
    beside other rows gives the same tokens; another seed gives others."""
    peft_model, tokenizer = policy
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2 plus 3?", "Hi", "What is 9 plus 9?")]
    seeds = [rollout.sampling_seed(42, 1, index, 0) for index in range(3)]
    sample = lambda rows, row_seeds: rollout.generate_completions(
        peft_model, rows, row_seeds, max_new_tokens=8, temperature=1.0, top_p=0.95,
        eos_ids=[tokenizer.eos_token_id], pad_id=tokenizer.pad_token_id, device=CPU)
    together = sample(prompts, seeds)
    assert sample(prompts[2:], seeds[2:]) == together[2:] and sample(prompts[:1], seeds[:1]) == together[:1]
    assert sample(prompts[:1], [rollout.sampling_seed(42, 2, 0, 0)]) != together[:1]


def test_every_completion_of_a_run_has_a_seed_of_its_own():
    """(step, prompt, generation) each move the seed, so no two completions of a run share one. Found by a bug bash
    (mutant G14, a seed that ignored the step: every step sampled the same completions): this arithmetic sat in a
    slow test for its model fixture; it needs none."""
    seeds = {rollout.sampling_seed(42, s, i, j) for s in range(3) for i in range(5) for j in range(8)}
    assert len(seeds) == 120
    assert rollout.sampling_seed(42, 1, 0, 0) != rollout.sampling_seed(43, 1, 0, 0)  # and train.seed moves it


@pytest.mark.slow  # ~5 s: a rollout and two forwards of the tiny model
def test_one_step_raises_the_log_probs_of_the_completions_with_an_advantage(tiny_llama, policy):
    """The whole chain on the real model: the rollout's completion log-probs are the plain full-vocabulary
    log-softmax at those tokens (the chunked head, the labels and the left padding line up), and one small SGD step on
    the GRPO loss raises sum(advantage x completion log-prob): the policy moves toward the completions that scored
    above their group."""
    from finetune.training import objectives
    from finetune.training.loss import token_logps

    peft_model, tokenizer = policy
    recipe = validate_recipe(grpo_recipe(tiny_llama, "unused.jsonl", "unused",
                                         {"reward_functions": ["finetune.rewards:length_penalty"]},
                                         train={"micro_batch_size": 8}))
    prompts = [data.Example(ids, [IGNORE_INDEX] * len(ids), row={"prompt": text}, prompt_index=i)
               for i, text in enumerate(["What is 2 plus 3?", "Hi"])
               for ids in [tokenizer(text)["input_ids"]]]
    objective = objectives.GRPO(peft_model, recipe, tokenizer)
    objective.step = 1
    (batch,) = objective.take(iter([data.collate(prompts, pad_id=tokenizer.pad_token_id)]), 1, 1)
    totals = objective.counts(peft_model, [batch], CPU)
    (roll,) = objective.rollouts
    assert roll.mask.shape[0] == 8 and objective.rollout_figures["reward_std"] > 0

    def score() -> torch.Tensor:
        with torch.no_grad():
            inputs = {k: roll.batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
            logits = peft_model(**inputs, use_cache=False).logits[:, :-1].float()
            plain = torch.log_softmax(logits, -1).gather(-1, roll.batch["input_ids"][:, 1:, None]).squeeze(-1)
            plain = plain[:, -roll.mask.size(1):] * roll.mask
            chunked = grpo.dense(token_logps(peft_model, roll.batch, CPU), roll.mask)
        torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-5)
        return (roll.advantages[:, None].float() * plain).sum()

    before = score()
    trained = [p for p in peft_model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in trained]  # the module's policy fixture is shared: put its weights back
    peft_model.train()
    to_backward, _, _ = objective.loss(peft_model, batch, totals, CPU)
    to_backward.backward()
    with torch.no_grad():
        for param in trained:
            param -= 0.05 * param.grad
            param.grad = None
    after = score()
    with torch.no_grad():
        for param, value in zip(trained, saved):
            param.copy_(value)
    assert after > before + 1e-3


@pytest.mark.slow  # ~5 s: a rollout of the tiny model
def test_every_sampled_completion_is_logged_with_its_rewards_and_advantage(tiny_llama, policy, tmp_path):
    """completions/rank0.jsonl: one line per completion, as TRL logs them (prompt, completion, each function's reward,
    the weighted reward, the advantage), equal to what the step trains on."""
    from finetune.training import objectives

    peft_model, tokenizer = policy
    recipe = validate_recipe(grpo_recipe(tiny_llama, "unused.jsonl", "unused",
                                         {"reward_functions": ["finetune.rewards:length_penalty",
                                                               "finetune.rewards:exact_match"],
                                          "reward_weights": [1.0, 0.5]}, train={"micro_batch_size": 8}))
    rows = [{"prompt": "What is 2 plus 3?", "answer": "5"}, {"prompt": "Hi", "answer": None}]
    prompts = [data.Example(ids, [IGNORE_INDEX] * len(ids), row=row, prompt_index=i)
               for i, row in enumerate(rows) for ids in [tokenizer(row["prompt"])["input_ids"]]]
    objective = objectives.GRPO(peft_model, recipe, tokenizer)
    objective.prepare(peft_model, [], [], recipe, pad_id=tokenizer.pad_token_id, out_dir=tmp_path, resume_from=None)
    objective.step = 3
    (batch,) = objective.take(iter([data.collate(prompts, pad_id=tokenizer.pad_token_id)]), 3, 1)
    objective.counts(peft_model, [batch], CPU)
    (roll,) = objective.rollouts
    lines = [json.loads(line) for line in (tmp_path / "completions" / "rank0.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and {line["step"] for line in lines} == {3}
    assert [line["prompt"] for line in lines] == [rows[0]["prompt"]] * 4 + [rows[1]["prompt"]] * 4
    assert [line["prompt_index"] for line in lines] == [0] * 4 + [1] * 4
    completions = tokenizer.batch_decode([ids[roll.mask[i].bool()] for i, ids in
                                          enumerate(roll.batch["input_ids"][:, -roll.mask.size(1):])],
                                         skip_special_tokens=True)
    assert [line["completion"] for line in lines] == completions
    assert [line["advantage"] for line in lines] == pytest.approx(roll.advantages.tolist(), abs=1e-6)
    for line, values in zip(lines, roll.rewards.tolist()):
        assert line["rewards"]["length_penalty"] == pytest.approx(values[0], abs=1e-6)
        assert (line["rewards"]["exact_match"] is None) == (line["prompt_index"] == 1)  # no answer: not scored
        scored = [w * v for w, v in zip((1.0, 0.5), values) if not math.isnan(v)]
        assert line["reward"] == pytest.approx(sum(scored), abs=1e-6)


@pytest.mark.slow  # ~10 s: two tiny models, a rollout each
def test_the_ratios_denominator_is_the_sampling_policy_and_disable_dropout_makes_the_first_ratio_one(tiny_llama):
    """Completions are sampled without dropout (seeded per completion); their old log-probs (num_iterations > 1) are
    that policy's, not a train-mode forward with LoRA dropout drawn afresh (TRL samples and scores one policy). With
    grpo.disable_dropout (TRL's name), the training forward scores them exactly as sampled: the first iteration's
    ratio is 1, bitwise."""
    from finetune.training import objectives
    from finetune.training.loss import token_logps

    def rollout_of(disable: bool):
        recipe = validate_recipe(grpo_recipe(tiny_llama, "unused.jsonl", "unused",
                                             {"reward_functions": ["finetune.rewards:length_penalty"], "num_iterations": 2,
                                              "disable_dropout": disable},
                                             train={"micro_batch_size": 8, "save_every": 2}, lora={"dropout": 0.5}))
        loaded = model.load_model(recipe, sharded=False, device=CPU, device_map=None, gradient_checkpointing=False)
        torch.manual_seed(0)
        with torch.no_grad():  # a trained adapter: LoRA B away from its zero start, so its dropout shows
            for name, param in loaded.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.5)
        tokenizer = model.load_tokenizer(recipe)
        prompts = [data.Example(ids, [IGNORE_INDEX] * len(ids), row={"prompt": text}, prompt_index=i)
                   for i, text in enumerate(["What is 2 plus 3?", "Hi"]) for ids in [tokenizer(text)["input_ids"]]]
        objective = objectives.GRPO(loaded.model, recipe, tokenizer)
        objective.step = 1
        loaded.model.train()
        (batch,) = objective.take(iter([data.collate(prompts, pad_id=tokenizer.pad_token_id)]), 1, 1)
        objective.counts(loaded.model, [batch], CPU)
        return loaded.model, objective.rollouts[0]

    peft_model, roll = rollout_of(disable=False)
    with torch.no_grad():
        peft_model.eval()
        as_sampled = grpo.dense(token_logps(peft_model, roll.batch, CPU), roll.mask)
        peft_model.train()
        with_dropout = grpo.dense(token_logps(peft_model, roll.batch, CPU), roll.mask)
    assert torch.equal(roll.old_logps, as_sampled) and not torch.equal(with_dropout, as_sampled)
    peft_model, roll = rollout_of(disable=True)
    with torch.no_grad():
        trained = grpo.dense(token_logps(peft_model, roll.batch, CPU), roll.mask)  # train mode, as the step's forward
    assert peft_model.training and torch.equal(trained, roll.old_logps)


@pytest.mark.slow  # ~5 s: a rollout and eight forwards and backwards of the tiny model
def test_a_rollout_trained_in_chunks_gives_the_whole_rollouts_loss_and_gradient(tiny_llama, policy):
    """grpo.train_chunk_size: the 8 completions trained 3 + 3 + 2 at a time (three forwards and backwards) against all
    8 in one, for every loss_type: the same loss, gradient and clip/KL sums (each chunk's share is its part of the
    step's sums; a chunk normalized by its own completions or tokens would fail here, by a factor of the chunks)."""
    from finetune.training import objectives

    peft_model, tokenizer = policy
    prompts = [data.Example(ids, [IGNORE_INDEX] * len(ids), row={"prompt": text}, prompt_index=i)
               for i, text in enumerate(["What is 2 plus 3?", "Hi"])
               for ids in [tokenizer(text)["input_ids"]]]
    trained = [p for p in peft_model.parameters() if p.requires_grad]
    was_training = peft_model.training
    peft_model.eval()  # no dropout: the whole and the chunked forwards see the same network
    try:
        for loss_type in ("grpo", "dr_grpo", "dapo"):
            recipe = validate_recipe(grpo_recipe(tiny_llama, "unused.jsonl", "unused",
                                                 {"reward_functions": ["finetune.rewards:length_penalty"],
                                                  "loss_type": loss_type, "train_chunk_size": 3, "beta": 0.1},
                                                 train={"micro_batch_size": 8}))
            objective = objectives.GRPO(peft_model, recipe, tokenizer)
            objective.step = 1
            (batch,) = objective.take(iter([data.collate(prompts, pad_id=tokenizer.pad_token_id)]), 1, 1)
            totals = objective.counts(peft_model, [batch], CPU)
            (whole,) = objective.rollouts
            chunks = objective.train_batches([batch])
            assert [c.mask.size(0) for c in chunks] == [3, 3, 2]
            assert torch.equal(torch.cat([c.advantages for c in chunks]), whole.advantages)
            assert torch.equal(torch.cat([c.ref_logps for c in chunks]), whole.ref_logps)

            def train_on(parts, objective=objective, batch=batch, totals=totals):
                objective.trained, objective.position = parts, 0
                loss, sums = 0.0, 0.0
                for part in parts:
                    to_backward, share, part_sums = objective.loss(peft_model, batch, totals, CPU)
                    to_backward.backward()
                    loss, sums = loss + share, sums + part_sums
                grads = [p.grad.clone() for p in trained]
                for p in trained:
                    p.grad = None
                return loss, sums, grads

            whole_loss, whole_sums, whole_grads = train_on([whole])
            chunk_loss, chunk_sums, chunk_grads = train_on(chunks)
            torch.testing.assert_close(chunk_loss, whole_loss, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(chunk_sums, whole_sums, rtol=1e-5, atol=1e-7)
            for chunked, expected in zip(chunk_grads, whole_grads):
                torch.testing.assert_close(chunked, expected, rtol=1e-4, atol=1e-7)
            assert any(g.abs().sum() > 0 for g in whole_grads), loss_type
    finally:
        peft_model.train(was_training)


def test_sequences_mask_the_completion_tokens_and_cut_completions():
    inputs, mask, truncated = grpo.sequences([[5, 6], [7]], [[1, 2, 9], [3, 4]], pad_id=0, eos_ids=[9],
                                             mask_truncated=True)
    assert inputs["input_ids"].tolist() == [[5, 6, 1, 2, 9], [0, 7, 3, 4, 0]]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]
    assert inputs["position_ids"][1].tolist()[1:4] == [0, 1, 2]
    assert truncated.tolist() == [False, True] and mask.tolist() == [[1, 1, 1], [0, 0, 0]]  # the cut one: no loss
    assert inputs["labels"].tolist() == [[-100, -100, 1, 2, 9], [-100] * 5]


def test_a_prompt_repeated_by_its_weight_draws_completions_of_its_own(tiny_llama, tmp_path):
    """Found by a bug bash (determinism): a dataset at weight 2 repeated each prompt as the same example, whose
    completions were drawn from the same seeds: two copies in one step gave identical completions (a doubled gradient
    of the same samples, where TRL samples each copy afresh). Copies are numbered, and draw seeds of their own."""
    from finetune.training.objectives.grpo.rollouts import completion_seeds
    from finetune.training.objectives.grpo.sampling import sampling_seed

    rows = [{"prompt": "What is 2 plus 3?"}, {"prompt": "What is 1 plus 1?"}]
    (train, _, _), _ = _prompts(tiny_llama, rows, tmp_path, datasets=[
        {"path": str(tmp_path / "rows.jsonl"), "format": "prompt", "weight": 2}])
    assert sorted((e.prompt_index, e.copy) for e in train) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    batch = data.collate(sorted(train, key=lambda e: (e.prompt_index, e.copy)), pad_id=0)
    seeds = completion_seeds(7, 3, batch, 2)
    assert len(set(seeds)) == 8  # 2 prompts x 2 copies x G=2, all different
    assert seeds[:2] == [sampling_seed(7, 3, 0, 0), sampling_seed(7, 3, 0, 1)]  # a first copy's: as before
