"""The recipe: a closed, typed schema loaded from YAML, with `key.path=value` overrides.

Every section is a pydantic model with `extra="forbid"`, so a misspelled key is an error (with the nearest
valid key suggested), never silently ignored. All problems of a recipe are reported at once, each with the
file and the dotted key path. Overrides from the command line are applied to the raw YAML before validation,
so they go through exactly the same checks.

Stable contract (outside scripts rely on these keys): `model.name_or_path`, `output.dir`, `train.max_steps`,
`train.seed`, `train.learning_rate`.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from finetune.chat_templates import checked_chat_template
from finetune.errors import RecipeError
from finetune.precision import DtypeChoice, choose_dtype, target_device
from finetune.recipe.checks import (
    check_checkpointing,
    check_dtypes,
    check_flash_attention,
    check_keep_best,
    check_objective,
    check_streaming,
    clamped_warmup,
    steps_for_epochs,
)
from finetune.recipe.data import DataSection
from finetune.recipe.objectives import sections
from finetune.recipe.overrides import apply_override, parse_override
from finetune.recipe.paths import beside_the_recipe, check_no_variables
from finetune.recipe.text import absolute_local_paths, format_errors, read_yaml  # read_yaml: also the CLI's
from finetune.recipe.train import TrainSection
from finetune.recipe_library import resolve_recipe_path

DType = Literal["bfloat16", "float16", "float32"]


class _Section(BaseModel):
    # allow_inf_nan=False: `1e999` and `.inf` are refused at their key ("finite number"), not an OverflowError later
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelSection(_Section):
    name_or_path: str = Field(description="Hub id or local folder of a causal LM.")
    gguf_file: str | None = Field(None, description="GGUF file inside name_or_path to load (dequantized) instead of safetensors.")
    tokenizer: str | None = Field(None, description="Tokenizer hub id or folder; default: name_or_path.")
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="dtype of every non-quantized weight, and of the 4-bit storage. auto: bfloat16 where the "
        "device computes it natively (CUDA compute capability >= 8.0, CPUs with AVX512-BF16 or AMX), float32 elsewhere.")
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto", description="auto: sdpa where the model class supports it, else eager (said in one line when the model "
        "config is read; gpt-oss has no sdpa). flash_attention_2 needs the flash-attn package and a CUDA device.")
    adapter: str | None = Field(None, description="A PEFT adapter folder (e.g. runs/sft/adapter) to start LoRA from instead of a fresh init: its "
                                "LoRA layout (r, alpha, rslora, dora, bias, targets, trained routers) is used; lora keys set to other values are "
                                "refused (lora.dropout is the recipe's). With train.objective: dpo it is also the reference.")
    chat_template: str | None = Field(None, description="Chat rows' template instead of the tokenizer's (a base model "
                                      "has none): a name (finetune/templates/SOURCES.md), a .jinja file, or its text.")
    quantized_cache: Literal["auto", "off"] = Field(
        "off", description="auto: a bf16 base is quantized once into $FINETUNE_CACHE/quantized; later starts load "
        "those 4-bit bytes (docs/distributed.md).")

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, value: str | None) -> str | None:
        return checked_chat_template(value)

    @field_validator("quantized_cache", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:  # YAML reads a bare `off` as false (and `on` as true)
        return {False: "off", True: "auto"}[value] if isinstance(value, bool) else value


class QuantizationSection(_Section):
    method: Literal["nf4", "fp4", "none"] = "nf4"
    double_quant: bool = True
    compute_dtype: DType | None = Field(None, description="4-bit matmul dtype; default model.dtype.")
    quant_storage: DType | None = Field(
        None, description="dtype the packed 4-bit weights are stored in: model.dtype, its default, in every strategy (what FSDP "
        "shards, and what a run's checkpoints move between strategies in); another value is refused.")


class LoraSection(_Section):
    r: int = Field(16, gt=0)
    alpha: float = Field(32, gt=0)
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    rslora: bool = False
    dora: bool = False
    bias: Literal["none", "all", "lora_only"] = "none"
    train_router: bool = Field(False, description="MoE: train the routers in full (PEFT modules_to_save); false: frozen.")
    fused: bool = Field(
        True, description="LoRA through finetune's fused autograd function (compute in model.dtype, fp32 master "
        "weights, dropout mask regenerated, no fp32 input copies). False: PEFT's own forward.")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _names_or_all_linear(cls, value):
        """One message for a bare name (pydantic's would be one per branch of the union, naming its types)."""
        if isinstance(value, str) and value != "all-linear":
            raise ValueError(f"a list of module names (e.g. [{value}], or [q_proj, k_proj, v_proj, o_proj]) or "
                             "`all-linear`")
        if isinstance(value, list) and not value:  # PEFT would stop with a traceback (NoMatchingPeftModuleError)
            raise ValueError("an empty list puts LoRA on no module, so nothing would train. Fix: list module names "
                             "(e.g. [q_proj, k_proj, v_proj, o_proj]) or use `all-linear`")
        if isinstance(value, list) and "all-linear" in value:
            raise ValueError("`all-linear` is a keyword, not a module name. Fix: write it without brackets "
                             "(`target_modules: all-linear`), or list module names only")
        return value


class ParallelSection(_Section):
    strategy: Literal["auto", "single", "ddp", "fsdp", "deepspeed", "layer_split"] = "auto"
    fsdp_version: Literal[1, 2] | None = Field(None, description="Default: the accelerate config's, else 2.")
    reshard_after_forward: bool | None = Field(None, description="True: full shard; False: shard-grad-op.")
    hybrid_shard: bool | None = Field(None, description="FSDP over several machines: shard within each machine and "
                                      "replicate across machines (HSDP; accelerate's fsdp_sharding_strategy: "
                                      "HYBRID_SHARD). Default: the accelerate config's, else false (shard over all ranks).")
    cpu_offload: bool | None = None
    zero_stage: Literal[2, 3] | None = Field(None, description="DeepSpeed ZeRO stage (strategy deepspeed): 3 shards everything, 2 "
                                             "optimizer state and gradients. Default: the DeepSpeed config's, else 3.")
    deepspeed_config: str | None = Field(
        None, description="A DeepSpeed JSON config (strategy deepspeed): its zero_optimization tuning is used; batch "
        "sizes, optimizer and clipping come from the recipe. Default: the accelerate config's deepspeed_config_file."
    )
    layer_class: str | None = Field(None, description="Decoder layer class to wrap; default from the model.")
    activation_checkpointing: bool | None = Field(
        None, description="Recompute each decoder layer's activations in the backward, in every strategy (FSDP's "
        "name for train.gradient_checkpointing). Default: train.gradient_checkpointing; set, it decides.")
    strict: bool = Field(False, description="On GPUs: refuse (instead of warn) a strategy the planner says will not fit.")
    sharded_loading: bool = Field(True, description="FSDP: build, quantize and shard one decoder layer at a time, so no "
                                  "rank ever holds the whole base. False: every rank loads the full 4-bit base first (v1).")
    collective_timeout_s: int = Field(600, gt=0, description="Seconds a rank waits in a collective (all-reduce, all-gather) "
                                      "for a peer that stopped answering before the run fails, naming that peer.")


class OutputSection(_Section):
    dir: str = Field("runs/default", description="Run folder: adapter/, checkpoints/, metrics.jsonl, recipe.yaml.")
    overwrite: bool = Field(False, description="Replace a finished (or unfinished) run already in output.dir.")


class EvalSection(_Section):
    generation_rows: int = Field(0, ge=0, description="Held-out examples answered greedily before and after training and scored (0: off).")
    metric: Literal["exact_match", "contains", "prefix_match"] = Field(
        "exact_match", description="How a generated answer is compared with the held-out reference answer.")
    max_new_tokens: int = Field(32, gt=0, description="Longest generated answer, in tokens.")


class _RecipeCore(_Section):
    """The sections every recipe has; Recipe (below) adds each objective's section from the registry, then the rest."""

    _notes: list[str] = PrivateAttr(default_factory=list)
    _dtype_choice: DtypeChoice | None = PrivateAttr(None)
    _length_origin: str | None = PrivateAttr(None)  # how train.num_epochs became max_steps, once resolved
    description: str = ""
    model: ModelSection
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    data: DataSection
    train: TrainSection = Field(default_factory=TrainSection)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections_take_defaults(cls, values: Any) -> Any:
        # A section header whose keys are all commented out (`quantization:` then `# method: nf4`) is null in YAML:
        # it means the section's defaults, as leaving the section out does (it meant `quantization: none`: plain
        # LoRA, silently). The command line's `quantization=null` is refused before (recipe/overrides.py).
        if isinstance(values, dict):
            optional = {name for name, field in cls.model_fields.items() if not field.is_required()}
            values = {key: value for key, value in values.items() if value is not None or key not in optional}
        return values

    @field_validator("quantization", mode="before")
    @classmethod
    def _scalar_quantization(cls, value: Any) -> Any:
        # `quantization: none` (or `nf4`) is the short form of `quantization: {method: ...}`.
        if isinstance(value, str):
            return {"method": value}
        if value is False:
            return {"method": "none"}
        return value

    @model_validator(mode="after")
    def _cross_field(self, info: ValidationInfo) -> Recipe:
        # model.dtype: auto becomes the device's dtype here, once, before every check that reads it; the resolved
        # recipe (written into the run folder) then says what the run trained in. context {"dtype_device": "gpu"}:
        # resolve for GPUs (the planner, on any machine).
        device = (info.context or {}).get("dtype_device", "here")
        if self._dtype_choice is None:
            self._dtype_choice = choose_dtype(self.model.dtype, device=device)
            self.model.dtype = self._dtype_choice.dtype
        check_dtypes(self)
        if self.model.attn_implementation == "flash_attention_2" and (info.context or {}).get("trains", True):
            check_flash_attention(self, "cuda" if device == "gpu" else target_device()[0])
        check_checkpointing(self)
        check_objective(self)
        check_streaming(self)
        check_keep_best(self)
        if self.train.num_epochs is None:  # with num_epochs, once the run knows its steps (resolve_num_epochs)
            self._length_notes()
        return self

    def _length_notes(self) -> None:
        """The notes of the run's length, once known: a warmup longer than the run, a GRPO cycle the run cuts short."""
        from finetune.recipe.grpo import cut_cycle

        self._notes += [note for note in (clamped_warmup(self.train), cut_cycle(self)) if note]

    def resolve_num_epochs(self, steps_per_epoch: int, *, launch: str) -> str | None:
        """train.num_epochs -> train.max_steps = ceil(num_epochs x steps_per_epoch) for the launch `launch`, then the
        warmup check; returns how max_steps was resolved (None: the recipe gave it). Done once, before anything reads
        max_steps (a resume resolves the same). num_epochs becomes null: the resolved recipe (the run folder's, which
        export reloads) sets one of the two like any recipe, a comment on top saying where max_steps came from."""
        t = self.train
        if t.num_epochs is None:
            return None
        steps = steps_for_epochs(t.num_epochs, steps_per_epoch)
        self._length_origin = (f"train.max_steps {steps} = ceil(train.num_epochs {t.num_epochs:g} x {steps_per_epoch} "
                               f"steps per epoch; {launch})")
        t.num_epochs = None  # first: max_steps beside num_epochs is refused
        t.max_steps = steps
        self._length_notes()
        return self._length_origin

    def __eq__(self, other: object) -> bool:
        # Two recipes are equal when they say the same thing: what validation noted on the way (the dtype choice of
        # model.dtype: auto, a clamped warmup) is about how each was read, not part of it.
        return isinstance(other, Recipe) and self.model_dump() == other.model_dump()

    __hash__ = None  # mutable (validate_assignment), as pydantic models are

    @property
    def dtype_choice(self) -> DtypeChoice | None:
        """What model.dtype resolved to, and why (None only for a recipe built without validation)."""
        return self._dtype_choice

    @property
    def notes(self) -> list[str]:
        """What validation adjusted in the recipe (printed once by `load_recipe`)."""
        return list(self._notes)

    # Resolved values used by the stages (one place for the defaults that depend on other keys).
    @property
    def rows_per_micro_batch(self) -> int:
        """Data rows per rank per micro-batch: train.micro_batch_size; GRPO's prompts (it counts completions)."""
        return self.train.micro_batch_size // (self.grpo.num_generations if self.train.objective == "grpo" else 1)

    @property
    def compute_dtype(self) -> str:
        return self.quantization.compute_dtype or self.model.dtype


def _default(section: type[BaseModel]):
    return (section, Field(default_factory=section))


# The objectives' sections (dpo:, kto:, grpo:, reward:, ...: recipe/objectives.py) after train:, then the others.
Recipe = create_model("Recipe", __base__=_RecipeCore, __module__=__name__,
                      **{key: _default(section) for key, section in sections().items()},
                      parallel=_default(ParallelSection), output=_default(OutputSection), eval=_default(EvalSection))
_SCHEMA_ROOT = Recipe


def load_recipe(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (), *,
                dtype_device: Literal["here", "gpu"] = "here") -> Recipe:
    """Read, override and validate a recipe; raise RecipeError listing every problem at once. `dtype_device`: which
    device model.dtype: auto is resolved for (this process's, or GPUs when planning for them). `path` may name a
    library recipe (`quickstart`), as on the command line."""
    path = resolve_recipe_path(os.fspath(path))
    raw = read_yaml(path)
    for text in overrides:
        parts, value = parse_override(text, root=_SCHEMA_ROOT)
        apply_override(raw, parts, value, text, root=_SCHEMA_ROOT)
    check_no_variables(raw, str(path))
    beside = beside_the_recipe(raw, path)  # said once the recipe is valid
    absolute_local_paths(raw)  # recipe.yaml and the adapter then name the files trained, read from anywhere
    recipe = validate_recipe(raw, source=str(path), dtype_device=dtype_device)
    for warning in beside if _says_here() else ():
        print(f"[finetune] warning: {warning}", file=sys.stderr, flush=True)
    return recipe


_ANNOUNCE = [True]  # False inside `announcements_muted()`


@contextmanager
def announcements_muted() -> Iterator[None]:
    """No dtype line, warning or note while validating here: `finetune train`'s pre-flight in the parent, whose
    launched rank 0 validates the same recipe again and says them once."""
    _ANNOUNCE[0] = False
    try:
        yield
    finally:
        _ANNOUNCE[0] = True


def announcing() -> bool:
    """Whether a line about how the recipe was resolved is said here (not inside `announcements_muted`)."""
    return _ANNOUNCE[0]


def _says_here() -> bool:
    return os.environ.get("RANK", "0") in ("", "0") and _ANNOUNCE[0]  # once per run, not once per rank


def validate_recipe(raw: dict, *, source: str = "<recipe>", dtype_device: Literal["here", "gpu"] = "here",
                    trains: bool = True) -> Recipe:
    """`trains`: False for a recipe a run wrote, read to export or generate from it (no check of what only training
    needs of this machine: flash attention trained on a GPU is sdpa on a CPU, finetune/model/base.py)."""
    booleans = booleans_at_numbers(raw, _SCHEMA_ROOT)  # listed with pydantic's problems, first
    try:
        recipe = Recipe.model_validate(raw, context={"dtype_device": dtype_device, "trains": trains})
    except ValidationError as exc:
        raise RecipeError(format_errors(exc, source, root=_SCHEMA_ROOT, first=booleans)) from None
    if booleans:
        raise RecipeError(format_errors(None, source, root=_SCHEMA_ROOT, first=booleans))
    if _says_here():
        # stderr: `plan --json` stays JSON
        choice = recipe.dtype_choice
        if choice is not None and choice.requested == "auto":
            print(f"[finetune] dtype: {choice.dtype} (model.dtype: auto; {choice.reason})", file=sys.stderr, flush=True)
        if choice is not None and choice.warning:
            print(f"[finetune] warning: {choice.warning}", file=sys.stderr, flush=True)
        for note in recipe.notes:
            print(f"[finetune] note: {note}", file=sys.stderr, flush=True)
    return recipe


# ------------------------------------------------------------------------------- YAML booleans at number keys
def booleans_at_numbers(value: Any, annotation: Any, path: tuple = ()) -> list[str]:
    """A `  key: why` line for each YAML boolean the recipe `value` gives where the schema (`annotation`: a model, a
    section, a list of them ...) takes a number and no boolean. pydantic's lax mode reads true as 1 and false as 0, and
    YAML 1.1 reads yes/no and on/off as booleans: `lora.r: yes` trained rank 1, `train.max_steps: true` one step,
    `keep_last: on` kept one checkpoint, all without a word (bug bash bb56). Walked from the schema's annotations, so
    every section is covered, those of other modules (train:, data:, the objectives') too; a field whose own `before`
    validator reads a boolean (quantized_cache's `off`) is left to it."""
    members = _members(annotation)
    found: list[str] = []
    model = next((m for m in members if isinstance(m, type) and issubclass(m, BaseModel)), None)
    if isinstance(value, dict) and model is not None:
        converted = {name for decorator in model.__pydantic_decorators__.field_validators.values()
                     if decorator.info.mode != "after" for name in decorator.info.fields}
        for key, item in value.items():
            field = model.model_fields.get(key) if isinstance(key, str) else None
            if field is None:
                continue  # an unknown key: pydantic's error names it
            if isinstance(item, bool) and key not in converted and _takes_number_not_bool(field.annotation):
                found.append(_boolean_line((*path, key), item, field))
            else:
                found += booleans_at_numbers(item, field.annotation, (*path, key))
    elif isinstance(value, list):
        inner = next((get_args(m)[0] for m in members if get_origin(m) is list and get_args(m)), None)
        for index, item in enumerate(value if inner is not None else ()):
            if isinstance(item, bool) and _takes_number_not_bool(inner):
                found.append(_boolean_line((*path, index), item, None))
            else:
                found += booleans_at_numbers(item, inner, (*path, index))
    return found


def _members(annotation: Any) -> list:
    """The types an annotation admits: unions and Annotated unpacked, a Literal as its values' types."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _members(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [member for arg in get_args(annotation) for member in _members(arg)]
    if origin is Literal:
        return [type(choice) for choice in get_args(annotation)]  # Literal[1, 2]: int (True == 1 passes it)
    return [annotation]


def _takes_number_not_bool(annotation: Any) -> bool:
    members = _members(annotation)
    return any(member in (int, float) for member in members) and bool not in members and Any not in members


def _boolean_line(path: tuple, value: bool, field) -> str:
    key = str(path[-1])
    default = getattr(field, "default", None)
    example = default if isinstance(default, (int, float)) and not isinstance(default, bool) else 2
    unset = " (or null, for none)" if field is not None and type(None) in _members(field.annotation) else ""
    return (f"  {'.'.join(str(part) for part in path)}: expected a number, but YAML read the value as "
            f"{str(value).lower()} (it reads yes/no, on/off and true/false as booleans), which would be taken as the "
            f"number {int(value)}. Fix: write the number, e.g. `{key}: {example}`{unset}.")


def recipe_to_yaml(recipe: Recipe) -> str:
    # A max_steps resolved from num_epochs says so in a comment (the keys say max_steps only: the file must reload).
    # Text as written (`Grüße`, not "Gr\xFC\xDFe": its readers decode UTF-8), unless a NEL (U+0085) is in it: PyYAML
    # writes that one raw, which reads back as a line break.
    origin, values = (f"# {recipe._length_origin}\n" if recipe._length_origin else ""), recipe.model_dump(mode="json")
    text = yaml.safe_dump(values, sort_keys=False, allow_unicode=True)
    return origin + (yaml.safe_dump(values, sort_keys=False) if "\x85" in text else text)
