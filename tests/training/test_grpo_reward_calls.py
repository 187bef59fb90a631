"""GRPO's reward calls as TRL 1.16 makes them (bug bash 17): what a reward function returns and is refused for, its
signature checked with the recipe, TRL's trainer_state / log_metric / log_extra, async functions, reward models on
every chat-prompt shape (and the conversation the policy saw), names that must be unique, and the row a message names.

The rollout tests sample nothing: the policy's generation is replaced by fixed completions, so the reward call, the
figures and the completions log run as in training, in well under a second."""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import write_jsonl
from test_grpo import grpo_recipe

from finetune.errors import RecipeError, RewardError
from finetune.recipe import validate_recipe
from finetune.training.objectives.grpo import rewards as grpo_rewards
from finetune.training.objectives.grpo import rollouts

CPU = torch.device("cpu")


def _call(functions, completions=("a", "b"), columns=None, **keys) -> torch.Tensor:
    n = len(completions)
    return grpo_rewards.rewards_per_function(list(functions), ["q"] * n, list(completions), columns or {},
                                             [f"prompt row {i + 1} of p.jsonl (data.datasets[0])" for i in range(n)],
                                             completion_ids=[[1]] * n, **keys)


def _refusal(functions, **keys) -> str:
    with pytest.raises(RewardError) as caught:
        _call(functions, **keys)
    return str(caught.value)


class _Policy(torch.nn.Module):
    """What the rollout asks of the policy when generation is replaced: a generation config, train / eval."""

    generation_config = None


def _rollout(tokenizer, recipe, functions, examples, monkeypatch, tmp_path, *, step: int = 3):
    """One generation of `examples` (2 prompts, G = 4) scored by `functions`, the completions " 1", " 12", ... (each
    ended by EOS): the objective as grpo_rollouts reads it. Returns the objective (its figures, completion rows)."""
    from finetune import data

    def generate(model, prompts, seeds, **options):
        return [tokenizer(f" 1{'2' * (i % 4)}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                for i in range(len(prompts))]

    monkeypatch.setattr(rollouts, "generate_completions", generate)
    recipe.grpo.reward_weights = [1.0] * len(functions)
    objective = SimpleNamespace(config=recipe.grpo, tokenizer=tokenizer, recipe=recipe, functions=functions,
                                step=step, vllm=None, reference=None, completions_log=tmp_path / "rank0.jsonl")
    batch = data.collate(examples, pad_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    rollouts.grpo_rollouts(_Policy(), [batch], objective, CPU)
    return objective


@pytest.fixture
def prompts(tiny_llama, tmp_path):
    """(tokenizer, recipe, prompt examples) of 2 text prompts (rows 1-2 of a file of 3) and 2 chat prompts with
    data.system_prompt, as data/prompts.py builds them for training."""
    from transformers import AutoTokenizer

    from finetune.data.prompts import prompt_examples

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt": f"What is {i}?", "extra": i} for i in range(3)])
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"from": "human", "value": "Hi"}]},
                                                 {"prompt": [{"role": "user", "content": [{"type": "text",
                                                                                          "text": "Name one"}]}]}])
    values = grpo_recipe(tiny_llama, text, tmp_path / "out", train={"micro_batch_size": 8, "max_steps": 10})
    values["data"]["datasets"].append({"path": str(chat), "format": "prompt"})
    values["data"]["system_prompt"] = "Answer with one number."
    recipe = validate_recipe(values)
    examples, _, _ = prompt_examples(recipe, tokenizer)
    return tokenizer, recipe, examples


# ------------------------------------------------------------------------------------------ 1. not-finite rewards
def test_an_infinite_reward_is_refused_like_text_and_the_completions_log_is_plain_json(prompts, monkeypatch, tmp_path):
    """Found by a bug bash: a reward of inf (or -inf) passed as a number: the group's mean became inf and its std NaN,
    every advantage of the group (of the step, with scale_rewards: batch) 0, the reward metrics dropped, and the
    completions log wrote the `Infinity` token that JSON parsers refuse. Now it is refused as a string is; NaN stays
    TRL's "not scored"."""
    for bad in (math.inf, -math.inf):
        message = _refusal([lambda prompts, completions, bad=bad, **kw: [1.0, bad]])
        assert (f"grpo.reward_functions[0]: `<lambda>` returned {bad!r} for the completion of prompt row 2 of p.jsonl "
                "(data.datasets[0]). Fix: return finite floats, or None / NaN for not scored.") in message
    table = _call([lambda prompts, completions, **kw: [math.nan, 2.0]])
    assert math.isnan(table[0, 0]) and table[1, 0] == 2.0

    def logs_inf(prompts, completions, log_extra, **kwargs):  # a column of the log may hold what it likes
        log_extra("score", [math.inf] * len(completions))
        return [1.0] * len(completions)

    tokenizer, recipe, examples = prompts
    _rollout(tokenizer, recipe, [logs_inf], examples[:2], monkeypatch, tmp_path)
    text = (tmp_path / "rank0.jsonl").read_text()
    lines = [json.loads(line, parse_constant=lambda token: pytest.fail(f"not JSON: {token}")) for line in
             text.splitlines()]
    assert "Infinity" not in text and {line["extra"]["score"] for line in lines} == {"inf"}


# ------------------------------------------------------------------------------------------------ 2. reward models
def test_reward_models_render_every_chat_prompt_shape_and_join_without_a_template(tiny_llama):
    """Found by a bug bash: a reward model passed the row's raw prompt to apply_chat_template: ShareGPT turns raised
    UndefinedError, text parts TypeError, and a reward model without a chat template raised on chat prompts, each
    named as `grpo.reward_functions ... Fix the function`. Now the messages are normalized as the policy's prompt is,
    a tokenizer without a template takes the documented raw join, and a failure names grpo.reward_models[i]."""
    from transformers import AutoTokenizer

    from finetune.training.objectives.grpo.reward_models import RewardModel

    scorer = RewardModel.__new__(RewardModel)  # the rendering alone: no weights needed
    scorer.tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    answer = [{"role": "assistant", "content": "42"}]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 x 7?"}]
    expected = scorer.tokenizer.apply_chat_template(plain + answer, tokenize=False)
    shapes = ([{"from": "system", "value": "Be brief."}, {"from": "human", "value": "What is 6 x 7?"}],
              [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
               {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "6 x 7?"}]}])
    assert scorer.texts([*shapes, plain], [answer] * 3) == [expected] * 3
    scorer.tokenizer.chat_template = None  # a base model's tokenizer: the raw join docs/grpo.md describes
    assert scorer.texts([shapes[0], "What is 6 x 7?"], [answer, "42"]) == ["Be brief.\n\nWhat is 6 x 7?42",
                                                                              "What is 6 x 7?42"]

    class Broken:
        is_reward_model, path, __name__ = True, "/runs/rm", "rm"

        def __call__(self, prompts, completions, **kwargs):
            raise ValueError("no template")

    message = _refusal([lambda prompts, completions, **kw: [1.0, 1.0], Broken()])
    assert "grpo.reward_models[0]: `rm` (/runs/rm) raised ValueError: no template (on prompt row 1 of p.jsonl" in message
    assert "Fix the function" not in message and "grpo.reward_functions" not in message


# ------------------------------------------------------------------------------------- 3. a PEFT reward adapter
def test_a_peft_reward_adapter_without_a_tokenizer_takes_its_bases_and_a_missing_base_is_a_recipe_error(
        tiny_llama, tmp_path, monkeypatch):
    """Found by a bug bash: PeftModel.save_pretrained writes no tokenizer, and the reward model read the tokenizer
    from the adapter folder only: it failed after the policy's weights loaded, blaming the base. A base not on this
    machine was named only then too. Now the base's tokenizer is taken (as TRL does), and a missing base is named
    with the recipe."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from finetune.recipe.grpo import reward_model_problem
    from finetune.training.objectives.grpo.reward_models import RewardModel

    base = AutoModelForSequenceClassification.from_pretrained(tiny_llama, num_labels=1, dtype=torch.float32)
    get_peft_model(base, LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "rm")
    assert not (tmp_path / "rm" / "tokenizer_config.json").exists()
    assert reward_model_problem(str(tmp_path / "rm")) is None
    scorer = RewardModel(str(tmp_path / "rm"), dtype=torch.float32, device=CPU)
    assert scorer.tokenizer.name_or_path == str(tiny_llama) and len(scorer(["Hi"], [" there"])) == 1

    config = json.loads((tmp_path / "rm" / "adapter_config.json").read_text())
    for missing in ("/nowhere/base-7b", "someorg/not-on-this-machine-7b"):
        (tmp_path / "rm" / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": missing}))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        why = reward_model_problem(str(tmp_path / "rm")) or ""
        assert why.startswith(f"{tmp_path / 'rm'} is an adapter of ") and missing in why, why
        assert "Fix: bring the base to this machine and set base_model_name_or_path" in why


# ---------------------------------------------------------------------------------- 4. return mistakes and async
def test_return_mistakes_are_named_for_what_was_returned_and_async_functions_are_awaited():
    """Found by a bug bash: a function without `return`, one returning a float, and an `async def` one (which TRL 1.16
    awaits) were each reported as "raised TypeError ... (on the whole batch only ...)", after one more call per
    completion to find the row. Now the message says what it returned, calls it once, and async functions are
    awaited (a raising one named with its row)."""
    calls = []

    def forgot_return(prompts, completions, **kwargs):
        calls.append(len(completions))

    def scalar(prompts, completions, **kwargs):
        calls.append(len(completions))
        return 1.0

    assert "grpo.reward_functions[0]: `forgot_return` returned None, not a list of one float per completion (2 " \
           "here). Fix: return a list of one float (or None: not scored) per completion" in _refusal([forgot_return])
    assert "`scalar` returned a float (1.0), not a list of one float per completion" in _refusal([scalar])
    assert calls == [2, 2]  # once each: no search for a row that raises

    async def judge(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]

    async def strict(prompts, completions, **kwargs):
        if "bad" in completions:
            raise KeyError("bad")
        return [1.0] * len(completions)

    table = _call([judge, strict, judge], completions=["a", "bc"])
    assert table.tolist() == [[1.0, 1.0, 1.0], [2.0, 1.0, 2.0]]
    assert "grpo.reward_functions[1]: `strict` raised KeyError: 'bad' (on prompt row 2 of p.jsonl" in _refusal(
        [judge, strict], completions=["a", "bad"])


# ------------------------------------------------------------------------------------------------ 5. signatures
def test_a_reward_functions_signature_is_checked_with_the_recipe_and_a_missing_column_before_the_call(
        tiny_llama, tmp_path, monkeypatch):
    """Found by a bug bash: def f(completions) and def f(prompts, completions) (no **kwargs) passed `finetune
    validate` and failed at step 1, after the weights loaded. Now the recipe check names the argument it cannot take
    and says "accept **kwargs"; a required column the rows lack is named before the function is called."""
    (tmp_path / "sig_rewards.py").write_text(
        "def only_completions(completions):\n    return [1.0] * len(completions)\n"
        "def positional(prompts, completions):\n    return [1.0] * len(completions)\n"
        "def fine(prompts, completions, answer, trainer_state, **kwargs):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    values = grpo_recipe(tiny_llama, tmp_path / "p.jsonl", tmp_path / "out", {"reward_functions": [
        "sig_rewards:only_completions", "sig_rewards:positional", "sig_rewards:fine"]})
    with pytest.raises(RecipeError) as caught:
        validate_recipe(values)
    message = str(caught.value)
    assert "grpo.reward_functions[0]: `sig_rewards:only_completions` has no parameter `prompts` and no **kwargs" in message
    assert "grpo.reward_functions[1]: `sig_rewards:positional` has no parameter `completion_ids` and no **kwargs" in message
    assert "Fix: accept **kwargs" in message and "grpo.reward_functions[2]" not in message

    called = []

    def needs_answer(prompts, completions, answer, **kwargs):
        called.append(answer)
        return [1.0] * len(completions)

    message = _refusal([needs_answer], columns={"solution": ["5", "6"]})
    assert "grpo.reward_functions[0]: `needs_answer` needs `answer`, which is neither an argument of the call nor a " \
           "column of the rows (columns: solution;" in message and not called


# ------------------------------------------------------------- 6. TRL's trainer_state, log_metric and log_extra
def test_trls_trainer_state_log_metric_and_log_extra_reach_the_functions(prompts, monkeypatch, tmp_path):
    """Found by a bug bash: TRL 1.16 passes trainer_state, log_metric and log_extra to every reward function; finetune
    passed none, so a curriculum reward (trainer_state.global_step) failed. Now trainer_state carries TrainerState's
    global_step (updates done: the step minus 1, as TRL's at generation), max_steps and epoch; log_metric's values are
    the step's metric (their mean), log_extra's a column of the completions log."""
    states = []

    def curriculum(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
        states.append(trainer_state)
        log_metric("curriculum/progress", trainer_state.global_step / trainer_state.max_steps)
        log_extra("judged", [f"judged {c}" for c in completions])
        return [float(trainer_state.global_step)] * len(completions)

    async def judge(prompts, completions, log_metric, **kwargs):
        for value in (1.0, 3.0):
            log_metric("judge/calls", value)
        return [0.5] * len(completions)

    tokenizer, recipe, examples = prompts
    objective = _rollout(tokenizer, recipe, [curriculum, judge], examples[:2], monkeypatch, tmp_path, step=3)
    (state,) = states
    assert (state.global_step, state.max_steps, state.epoch, state.is_world_process_zero) == (2, 10, None, True)
    assert objective.rollout_figures["curriculum/progress"] == pytest.approx(0.2)
    assert objective.rollout_figures["judge/calls"] == pytest.approx(2.0)
    lines = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [line["extra"]["judged"] for line in lines] == [f"judged {line['completion']}" for line in lines]
    assert {line["rewards"]["judge"] for line in lines} == {0.5} and {line["reward"] for line in lines} == {2.5}


# ------------------------------------------------------------------- 8. the conversation the reward model scores
def test_reward_models_score_the_conversation_the_policy_saw_and_functions_get_the_rows_prompt(
        prompts, monkeypatch, tmp_path):
    """Found by a bug bash: with data.system_prompt (or a `system` column) the policy's prompt had a system turn, but
    the reward model scored the row's prompt without it: another conversation than the one answered. Reward functions
    keep the row's prompt, as TRL passes it."""
    seen = {}

    def function(prompts, completions, **kwargs):
        seen["function"] = prompts
        return [1.0] * len(completions)

    class Model:
        is_reward_model, path, __name__ = True, "/runs/rm", "rm"

        def __call__(self, prompts, completions, **kwargs):
            seen["model"] = prompts
            return [0.0] * len(completions)

    tokenizer, recipe, examples = prompts
    _rollout(tokenizer, recipe, [function, Model()], examples[3:], monkeypatch, tmp_path)
    system = {"role": "system", "content": "Answer with one number."}
    assert seen["model"][::4] == [[system, {"role": "user", "content": "Hi"}],
                                  [system, {"role": "user", "content": "Name one"}]]
    assert seen["function"][::4] == [examples[3].row["prompt"], examples[4].row["prompt"]]


# ------------------------------------------------------------------------------------------------- 7. names
def test_two_scorers_of_one_name_are_refused_with_the_recipe(tiny_llama, tmp_path, monkeypatch):
    """Found by a bug bash: two functions named `digits` (from two modules), or two reward models in folders named
    `run`, were logged under one key: the first one's values appeared nowhere. Now the recipe is refused naming both."""
    for module in ("dup_a", "dup_b"):
        (tmp_path / f"{module}.py").write_text("def digits(prompts, completions, **kwargs):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for side in ("a", "b"):
        (tmp_path / side / "run").mkdir(parents=True)
        (tmp_path / side / "run" / "config.json").write_text(json.dumps(
            {"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "LABEL_0"}}))
    values = grpo_recipe(tiny_llama, tmp_path / "p.jsonl", tmp_path / "out",
                         {"reward_functions": ["dup_a:digits", "dup_b:digits"],
                          "reward_models": [str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")]})
    with pytest.raises(RecipeError) as caught:
        validate_recipe(values)
    message = str(caught.value)
    assert "grpo.reward_functions[0] (`dup_a:digits`) and grpo.reward_functions[1] (`dup_b:digits`) are both named " \
           "`digits`, the key of their logged figures" in message
    assert f"grpo.reward_models[0] ({tmp_path / 'a' / 'run'}) and grpo.reward_models[1] ({tmp_path / 'b' / 'run'}) " \
           "are both named `run`" in message


# ------------------------------------------------------------------------------------- 9. the row a message names
def test_a_reward_error_names_the_prompts_file_row_and_its_prompt_index_in_the_completions_log(
        prompts, monkeypatch, tmp_path):
    """Found by a bug bash: the message said "prompt row 13" (the row in its file, from 1) for the prompt the
    completions log calls prompt_index 12, and the docs said the row was counted from 0. Now it names both."""
    def raises_on_1(prompts, completions, extra, **kwargs):
        if 1 in extra:
            raise ZeroDivisionError("one")
        return [1.0] * len(completions)

    tokenizer, recipe, examples = prompts
    with pytest.raises(RewardError) as caught:
        _rollout(tokenizer, recipe, [raises_on_1], examples[:2], monkeypatch, tmp_path)
    assert (f"`raises_on_1` raised ZeroDivisionError: one (on prompt row 2 of {recipe.data.datasets[0].path} "
            "(data.datasets[0]), prompt_index 1 in the completions log)") in str(caught.value)


# ------------------------------------------------------------------------------------------ 10. a file's path
def test_a_reward_function_named_by_its_file_is_told_the_module_name():
    """Found by a bug bash: `myr.py:ok`, `./myr.py:ok` and `/abs/myr.py:ok` were told to check that myr/py.py is on
    PYTHONPATH, or that ./myr.py imports without error: advice for a module, not for a file named by its path."""
    from finetune.recipe.grpo import import_reward_function

    for name, where in (("myr.py:ok", "with myr.py in the folder you run from or on PYTHONPATH"),
                        ("./myr.py:ok", "with myr.py in the folder you run from or on PYTHONPATH"),
                        ("/abs/rewards/myr.py:ok", "with /abs/rewards on PYTHONPATH, or run from /abs/rewards")):
        with pytest.raises(ValueError) as caught:
            import_reward_function(name)
        assert str(caught.value) == (f"`{name}` names a file, not a module. Fix: name the module, not the file: "
                                     f"`myr:ok` ({where}).")



def test_reward_models_see_the_system_prompt_a_blank_system_turn_yielded_to(tmp_path):
    """Found by a bug bash: a blank system turn (OpenHermes' {"from": "system", "value": ""}) now yields to the system
    prompt in the policy's prompt (data/prompts.py, templates.with_system), but the reward models were given the blank
    turn: another conversation than the one answered."""
    from finetune.recipe import validate_recipe
    from finetune.training.objectives.grpo.rollouts import policy_prompts

    recipe = validate_recipe({"model": {"name_or_path": "x"}, "train": {"objective": "grpo", "micro_batch_size": 8},
                              "data": {"datasets": [{"path": str(tmp_path / "p.jsonl"), "format": "prompt"}],
                                       "system_prompt": "Answer with one number."},
                              "grpo": {"reward_functions": ["finetune.rewards:length_penalty"],
                                       "max_completion_length": 16}})
    row = {"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}]}
    assert policy_prompts([row], ["p.jsonl row 1 (data.datasets[0])"], recipe) == [
        [{"role": "system", "content": "Answer with one number."}, {"role": "user", "content": "Hi"}]]
