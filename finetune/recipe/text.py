"""Reading recipe text: the YAML file (its encoding, one document, aliases as copies, its leading comments), pydantic's
errors as one paragraph, "did you mean" for an unknown key, and paths or arguments a locale that is not UTF-8 cannot
name. Overrides (`key.path=value`) are finetune/recipe/overrides.py.

The schema itself (finetune/recipe/schema.py) passes its root model in, so this leaf knows nothing of the sections: a key is
checked against whatever schema the caller validates with, and an unknown one gets the nearest valid key suggested.
"""

from __future__ import annotations

import codecs
import datetime
import difflib
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from finetune.chat_templates import named_templates
from finetune.errors import DATA_PARALLEL_NAMES, RecipeError, data_parallel_refusal
from finetune.recipe.names import UNSET, foreign_name, managed_family, section_of
from finetune.recipe_library import file_bytes


def field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def schema_at(root: type[BaseModel], path: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The pydantic model class under `root` that holds the keys at `path` (for key suggestions)."""
    current: type[BaseModel] | None = root
    for part in path:
        if current is None or isinstance(part, int):
            continue
        field = current.model_fields.get(part)
        if field is None:
            return None
        annotation = field.annotation
        nested = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not nested and getattr(annotation, "__origin__", None) is list:
            nested = [a for a in annotation.__args__ if isinstance(a, type) and issubclass(a, BaseModel)]
        current = nested[0] if nested else None
    return current


def section_keys(root: type[BaseModel]) -> dict[str, list[str]]:
    """Every section of the schema -> its keys (data.datasets' keys under `data.datasets[]`)."""
    sections = {}
    for name in root.model_fields:
        schema = schema_at(root, (name,))
        if schema is not None:
            sections[name] = field_names(schema)
            for inner in schema.model_fields:
                nested = schema_at(root, (name, inner))
                if nested is not None:
                    sections[f"{name}.{inner}[]"] = field_names(nested)
    return sections


def field_at(root: type[BaseModel], dotted: str):
    """The schema's field (pydantic FieldInfo) at a dotted key (`dpo.loss`, `data.datasets[].format`), or None."""
    *parents, leaf = dotted.replace("[]", "").split(".")
    parent = schema_at(root, tuple(parents))
    return parent.model_fields.get(leaf) if parent is not None else None


def suggest(key: str, candidates: list[str], *, root: type[BaseModel] | None = None, section: str | None = None,
            top_level: bool = False, value: Any = UNSET) -> str:
    """What to say of an unknown key: the key it means where it is another tool's name or belongs in another section
    (finetune/recipe/names.py; `value`, what was written for it, picks among keys and is checked against them),
    else a near spelling of a key here (close enough to be a typo, never a key of
    another meaning: `gradient_accumulation_steps` is not `gradient_checkpointing`; case aside: `LORA` is `lora`),
    else of another section's key, else what a family of other tools' names is (names.managed_family: `eval_*` ...),
    else the keys here. `top_level`: `key` is where the sections are (`training` is `train`)."""
    sections = section_keys(root) if root is not None else {}
    known = foreign_name(key, sections, section, top_level=top_level, value=value,
                         field=lambda dotted: field_at(root, dotted)) if root is not None else None
    if known:
        return f" {known}"
    if close := _near(key, candidates):
        return f" Did you mean `{close}`?"
    # a near spelling of another section's key (`train.eval_fracton`: data.eval_fraction), then a family of HF's names
    # by prefix (`eval_accumulation_steps`): asked after our own keys, several of which start alike (bb56)
    elsewhere = {f"{name}.{inner}": inner for name, keys in sections.items() if "[]" not in name and name != section
                 and not top_level and section is not None for inner in keys}
    if (close := _near(key, list(elsewhere.values()))) is not None:
        homes = " or ".join(f"`{dotted}`" for dotted, inner in elsewhere.items() if inner == close)
        return f" Did you mean {homes} (another section's key: move it there)?"
    if family := managed_family(key):
        return f" {family}"
    return f" Valid keys here: {', '.join(candidates)}."


def _near(key: str, candidates: list[str]) -> str | None:
    """The candidate close enough to `key` to be its typo (or the same key in another case), else None."""
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.8)
    close = close or difflib.get_close_matches(key.lower(), candidates, n=1, cutoff=0.8)
    return close[0] if close else None


def not_text(value: Any, key: str) -> str:
    """What to say of a value YAML typed where text is expected (`output.dir: 2024-01-01` is a date, `12:30` the number
    750 in YAML 1.1, `yes` true, `a: b` or `{...}` a mapping): how it was read, and to quote it."""
    if isinstance(value, dict):
        kind = f"a mapping ({value!r}): a `: ` or `{{...}}` inside a value starts one"
    elif isinstance(value, list):
        kind = f"a list ({value!r}): a value starting with `[` is one"
    elif isinstance(value, bool):
        kind = f"{str(value).lower()}: YAML reads yes/no, on/off and true/false as booleans"
    elif isinstance(value, (datetime.date, datetime.datetime)):
        kind = f"a date ({value})"
    elif isinstance(value, (int, float)):
        kind = f"the number {value!r} (YAML 1.1 reads 12:30 as 750, in base 60, and 0042 as octal 34)"
    else:
        kind = f"{type(value).__name__} {value!r}"
    example = f"'{value}'" if isinstance(value, (datetime.date, datetime.datetime)) else "'...'"
    return (f"expected text, but YAML read the value as {kind}. Fix: put the text in quotes, as written: "
            f"`{key}: {example}`.")


def format_errors(error: ValidationError | None, source: str, *, root: type[BaseModel],
                  first: list[str] = ()) -> str:
    """pydantic's errors as one paragraph: the file, then each problem at its dotted key, with the nearest valid key.
    `first`: problems found before pydantic's (`  key: why` lines), listed ahead of them."""
    lines = list(first)
    for item in error.errors() if error is not None else ():
        loc = tuple(p for p in item["loc"] if p not in ("function-after[_cross_field()]",))
        dotted = ".".join(str(p) for p in loc) or "(recipe)"
        asked = item.get("input")
        if loc == ("parallel", "strategy") and isinstance(asked, str) and asked.strip().lower() in DATA_PARALLEL_NAMES:
            lines.append(f"  {dotted}: {data_parallel_refusal(source, asked)}")
        elif item["type"] == "extra_forbidden":
            parent = schema_at(root, loc[:-1])
            hint = (f" It is a key of an earlier finetune, {REMOVED_KEYS[dotted]}: delete it." if dotted in REMOVED_KEYS
                    else suggest(str(loc[-1]), field_names(parent), root=root, section=section_of(loc[:-1]),
                                 top_level=len(loc) == 1, value=item.get("input", UNSET)) if parent else "")
            lines.append(f"  {dotted}: unknown key.{hint}")
        elif item["type"] == "missing":
            lines.append(f"  {dotted}: required key is missing.")
        elif item["type"] == "string_type" and asked is not None:
            lines.append(f"  {dotted}: {not_text(asked, str(loc[-1]))}")
        else:
            got = item.get("input")
            got_text = "" if isinstance(got, dict) else f" (got {got!r})"
            msg = item["msg"].removeprefix("Value error, ")
            if item["type"] in ("less_than_equal", "less_than", "greater_than", "greater_than_equal"):
                msg = re.sub(r"\b\d{10,}\b", lambda m: f"{int(m.group()):.0e}", msg)  # 1e+30, not 31 digits
            lines.append(f"  {dotted}: {msg}{got_text}")
    plural = "s" if len(lines) > 1 else ""
    return f"{source}: {len(lines)} problem{plural} in the recipe:\n" + "\n".join(lines)


def absolute_store_uri(uri: str) -> str:
    """A local store's URI with its path made absolute from here: `sqlite:///rel.db`, `file:mlruns`, a plain path.
    Kept relative, trackers.json and the run's recipe named another database from any other folder: `finetune runs
    RUN` there found 0 runs (and MLflow created an empty database), a resume there started a second MLflow run in a
    second database (bb25). Other URIs, absolute paths and in-memory databases: as given."""
    if uri.startswith("sqlite:///") and uri not in ("sqlite:///", "sqlite:///:memory:"):
        path = uri.removeprefix("sqlite:///")
        return uri if path.startswith("/") else f"sqlite:///{os.path.abspath(Path(path).expanduser())}"
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return f"file:{os.path.abspath(Path(uri.removeprefix('file:')).expanduser())}"
    if "://" not in uri and not uri.startswith(("file:", "databricks", "uc:")) and uri not in ("", ":memory:"):
        return os.path.abspath(Path(uri).expanduser())  # MLflow reads a bare path as a file store
    return uri


def absolute_local_paths(raw: dict) -> None:
    """The recipe's local paths as absolute ones, where they name something that exists from here (the folder the
    command runs in, as the libraries read them): the model and tokenizer folders, model.adapter, a chat template
    file, data and tools files, reward model folders. The run's recipe.yaml and adapter_config.json
    (base_model_name_or_path) then say which files were trained wherever they are read from: `finetune generate`,
    `export` and a resume from another folder took the relative names for hub ids, or read another folder's files.
    Hub ids, template names and paths not found are left as written (their own checks name them). output.dir, which
    a first run creates, is made absolute whether it exists or not."""
    unnamed = []  # paths this locale cannot name: one paragraph for all of them

    def absolute(value, key: str, *, files_only: bool = False):
        if not isinstance(value, str) or not value or "\n" in value or "{" in value:
            return value
        if problem := locale_path_problem(value):
            unnamed.append(f"{key} `{value}`: {problem}")
            return value
        path = Path(value).expanduser()  # `~/x`: expanded here, or transformers took it for a hub id (bb25)
        if not (path.is_file() if files_only else path.exists()) or Path(value).is_absolute():
            return value
        return os.path.abspath(path)  # symbolic links kept as the user named them

    def fix(section, key, where: str, **options):
        if isinstance(section, dict) and key in section:
            section[key] = absolute(section[key], f"{where}.{key}", **options)

    model, data, grpo = (raw.get(name) if isinstance(raw, dict) else None for name in ("model", "data", "grpo"))
    for key in ("name_or_path", "tokenizer", "adapter"):
        fix(model, key, "model")
    template = model.get("chat_template") if isinstance(model, dict) else None
    if isinstance(template, str) and template not in named_templates():
        fix(model, "chat_template", "model", files_only=True)  # a named template wins over a file of its name
    for key in ("datasets", "eval_datasets"):
        for index, spec in enumerate((data.get(key) or []) if isinstance(data, dict) and isinstance(data.get(key),
                                                                                                   list) else []):
            fix(spec, "path", f"data.{key}[{index}]")
            fix(spec, "tools", f"data.{key}[{index}]", files_only=True)
    if isinstance(grpo, dict) and isinstance(grpo.get("reward_models"), list):
        grpo["reward_models"] = [absolute(entry, f"grpo.reward_models[{index}]")
                                 for index, entry in enumerate(grpo["reward_models"])]
    train = raw.get("train") if isinstance(raw, dict) else None
    if isinstance(train, dict) and isinstance(train.get("mlflow_tracking_uri"), str) and train["mlflow_tracking_uri"]:
        train["mlflow_tracking_uri"] = absolute_store_uri(train["mlflow_tracking_uri"])
    output = raw.get("output") if isinstance(raw, dict) else None
    if isinstance(output, dict) and isinstance(output.get("dir"), str) and output["dir"]:
        if problem := locale_path_problem(output["dir"]):
            unnamed.append(f"output.dir `{output['dir']}`: {problem}")
        # made before it exists: a resume from the run's recipe.yaml, launched elsewhere, finds this run's checkpoints
        output["dir"] = os.path.abspath(Path(output["dir"]).expanduser())
    if unnamed:
        raise RecipeError("\n".join(unnamed))


# The fix for text this process's locale cannot hold (an ISO-8859-x or C locale with Python's UTF-8 mode off)
UTF8_LOCALE_FIX = "Fix: run finetune in a UTF-8 locale (e.g. `export LC_ALL=C.UTF-8`) or with `PYTHONUTF8=1`."


def locale_name() -> str:
    """This process's file-name encoding with the locale setting it comes from: `ascii, LC_ALL=C`."""
    setting = next(((name, os.environ[name]) for name in ("LC_ALL", "LC_CTYPE", "LANG") if os.environ.get(name)), None)
    return sys.getfilesystemencoding() + (f", {setting[0]}={setting[1]}" if setting else "")


def undecodable_argument(argv: list[str]) -> str | None:
    """The paragraph refusing the first command-line argument that holds bytes this locale's encoding could not decode
    (Python keeps them as lone surrogates: `--prompt 你好` typed in a UTF-8 terminal under LC_ALL=C), unless it is
    the path of something that exists (the same bytes name it). Taken on, such text reached the tokenizer as a
    TypeError traceback, or a recipe value as other text than was typed. None: every argument is text."""
    for item in argv:
        if any("\udc80" <= char <= "\udcff" for char in item) and not os.path.lexists(item):
            shown = item.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")  # the bytes, as UTF-8
            return (f"the argument `{shown}` holds bytes that this locale's encoding ({locale_name()}) cannot decode "
                    "(text typed in a UTF-8 terminal?), so it would be read as other text than was typed. "
                    f"{UTF8_LOCALE_FIX}")
    return None


def locale_path_problem(value: str) -> str | None:
    """Why the path `value` (text of a recipe, which is UTF-8) names no file here when the locale's encoding is not
    UTF-8, else None: a character that encoding cannot hold (no file of that name can be opened: the run said "file
    not found" of a file `ls` shows, or crashed with a UnicodeEncodeError), or a file that exists under the name's
    UTF-8 bytes, which this locale writes as other bytes (`ü` in ISO-8859-1)."""
    encoding = sys.getfilesystemencoding()
    if value.isascii() or codecs.lookup(encoding).name == "utf-8":
        return None
    where = f"this locale's encoding ({locale_name()})"
    name = os.path.expanduser(value)
    try:
        local = name.encode(encoding, sys.getfilesystemencodeerrors())  # as os.fsencode names it to the system
    except UnicodeEncodeError:
        return f"the name cannot be written in {where}, so no file of that name can be opened. {UTF8_LOCALE_FIX}"
    utf8 = name.encode("utf-8", "surrogateescape")
    if utf8 != local and os.path.lexists(utf8) and not os.path.lexists(local):
        return (f"a file of that name exists in UTF-8, but {where} writes the name as other bytes, so it is not found. "
                f"{UTF8_LOCALE_FIX}")
    return None


# Keys a later finetune removed without a rename, and why. A recipe a run wrote is read back without them, with a note
# (`drop_removed_keys`); one the user writes now that sets one is refused, saying so (format_errors; bb70 F4).
REMOVED_KEYS = {
    "data.num_workers": "removed in e1c0ecd: rows are tokenized in data.num_proc processes",
}


def drop_removed_keys(raw: dict) -> list[str]:
    """Remove from `raw` the keys of REMOVED_KEYS it sets; returns them, each with why (`data.num_workers (removed
    in ...)`), for the note the caller prints."""
    dropped = []
    for dotted, why in REMOVED_KEYS.items():
        *sections, key = dotted.split(".")
        node = raw
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if isinstance(node, dict) and key in node:
            del node[key]
            dropped.append(f"{dotted} ({why})")
    return dropped


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, but a key given twice in one mapping is an error where PyYAML keeps the last one
    silently (a second `train:` section would replace the whole first one)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                if key is None or key == "<<":
                    continue
                if key in first:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"`{key}` is given twice in one mapping (first at line {first[key]}); YAML would "
                        "keep only the second. Merge the two", key_node.start_mark)
                first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | os.PathLike) -> dict:
    """A YAML file (a recipe, an accelerate config) as a dict whose every mapping and list is its own: an item written
    as an alias (`*cols`) is a copy of its anchor, so an override of one item never changes the other."""
    if not os.fspath(path):  # Path("") is `.`, which was named as the folder not found (bb56)
        raise RecipeError("the recipe argument is empty (''). Pass the path of a YAML recipe, or the name of a library "
                          "recipe (e.g. quickstart): `finetune recipes` lists the library.")
    path = Path(path)
    if not path.exists() or path.is_dir():  # a pipe, /dev/stdin or a FIFO is read: `<(...)` is a recipe given (bb56)
        hint = " (it is a folder)" if path.is_dir() else ""
        raise RecipeError(
            f"{path}: recipe file not found{hint}. Pass the path of a YAML recipe, or to the `finetune` verbs the name "
            "of a library recipe (e.g. quickstart): `finetune recipes` lists the library, and `finetune recipes copy "
            "NAME my.yaml` writes one out to edit."
        )
    try:
        raw = yaml.load(decoded(path), Loader=UniqueKeyLoader)  # (a SafeLoader)
        if isinstance(raw, dict):
            check_expanded_size(raw, path)
            raw = unshared(raw, path)
    except RecursionError:  # PyYAML's composer (and the copies) recurse per level: about 1,000 levels of `[` do it
        raise RecipeError(f"{path}: nested too deeply: a value holds lists or mappings inside each other about a "
                          "thousand levels deep or more, further than a recipe needs or the YAML reader follows. Fix: "
                          "write that value flat (a recipe's sections nest a few levels).") from None
    except yaml.YAMLError as exc:
        raise RecipeError(yaml_syntax_error(exc, path)) from None
    if raw is None:
        what = "is empty" if not decoded(path, strict=False).strip() else "holds only comments"
        raise RecipeError(f"{path}: the file {what}: a recipe is a YAML mapping with sections model, data, "
                          "train... Fix: `finetune recipes copy quickstart my.yaml` writes one out to edit.")
    if not isinstance(raw, dict):
        kind = "a list" if isinstance(raw, list) else f"the value {str(raw)[:40]!r}"  # not Python's type name
        raise RecipeError(f"{path}: a recipe must be a YAML mapping with sections model, data, train..., got {kind}.")
    return raw


def yaml_syntax_error(exc: yaml.YAMLError, path: str | os.PathLike) -> str:
    """PyYAML's error as one paragraph: the file, line and column, the problem in words, and the fix (a recipe's, an
    accelerate config's: PyYAML's own three lines, "while parsing a flow node ...", said neither, bb56)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    fix = ("Fix the YAML at that place (text that starts with [, {, %, *, &, ! or @, or holds `: ` or ` #`, "
           "goes in quotes: `key: '...'`).")
    if "'\\t'" in problem or "tab character" in problem:  # a tab indents a line or ends one: quotes do not help
        problem = "a tab character, which YAML does not take for indentation or between tokens"
        fix = "Fix: replace the tab with spaces (an editor's \"convert tabs to spaces\" does every line)."
    elif context == "expected a single document in the stream":  # PyYAML's problem: "but found another document"
        problem = "a second YAML document starts here (a `---` line after the first); a recipe is one document"
        fix = "Fix: remove that `---` line, or keep one document per file."
    elif context:
        problem = f"{context}, {problem}"
    return f"{path}:{where}: YAML syntax error: {problem}. {fix}"


def decoded(path: Path, *, strict: bool = True) -> str:
    """The file's text: UTF-8, or the Unicode encoding its byte-order mark names (UTF-16 is what Windows Notepad saves
    as "Unicode"). Any other encoding is refused naming the line, never a UnicodeDecodeError traceback; not `strict`:
    read as UTF-8 with the bytes that are not replaced (for a look at the comments: the loader refuses the file)."""
    data = file_bytes(path)
    for bom, codec in ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
                       (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16")):
        if data.startswith(bom):
            try:
                return data.decode(codec)
            except UnicodeDecodeError:
                break
    if not strict:
        return data.decode("utf-8", errors="replace")
    if b"\x00" in data:  # UTF-16 without a byte-order mark: every other byte of ASCII text is 0
        raise RecipeError(f"{path}: the file is not UTF-8 text (it holds NUL bytes: UTF-16 without a byte-order mark?). "
                          "Fix: save it as UTF-8 (in most editors: Save As, encoding UTF-8).")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        latin = data[exc.start:exc.start + 1].decode("latin-1")
        raise RecipeError(
            f"{path}: line {line}: the file is not UTF-8 text (byte 0x{data[exc.start]:02x}, `{latin}` in Latin-1 or "
            "Windows-1252). Fix: save it as UTF-8 (in most editors: Save As, encoding UTF-8).") from None


def leading_comments(path: str | os.PathLike) -> list[str]:
    """The comment lines a recipe starts with (`# accelerate config: ...`, what writes its data file), from its text
    decoded as the recipe loader decodes it. Read raw before, a byte-order mark hid the first comment and UTF-16 every
    line: a recipe saved by a Windows editor lost its named launch and ran one process. [] where it cannot be read."""
    try:
        text = decoded(Path(path), strict=False)
    except OSError:
        return []
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


# Values a recipe may hold once its aliases are written out (each alias a copy: `unshared`). A recipe needs a few
# hundred; nested aliases multiply (`a1: [*a0 x10]`, `a2: [*a1 x10]` ...: 700 bytes are 10**9 values), so a file from
# elsewhere could take every byte of memory before any key is checked. A file without aliases is never refused.
MAX_EXPANDED_VALUES = 100_000


def check_expanded_size(raw: dict, path: Path) -> None:
    """Refuse a recipe whose aliases, written out, hold more than MAX_EXPANDED_VALUES values. Counted with each
    shared mapping or list measured once (time linear in the file); an alias inside its own anchor is refused here."""
    sizes: dict[int, int] = {}
    aliased = [False]

    def size(node: Any, inside: frozenset[int]) -> int:
        if not isinstance(node, (dict, list)):
            return 1
        if id(node) in inside:
            raise RecipeError(f"{path}: a YAML alias refers to a mapping or list that holds it (`&name` ... `*name` "
                              "inside it), which has no end. Fix: write the value out instead of the alias.")
        if id(node) in sizes:
            aliased[0] = True
            return sizes[id(node)]
        inner = inside | {id(node)}
        sizes[id(node)] = 1 + sum(size(value, inner) for value in (node.values() if isinstance(node, dict) else node))
        return sizes[id(node)]

    total = size(raw, frozenset())
    if aliased[0] and total > MAX_EXPANDED_VALUES:
        raise RecipeError(f"{path}: its YAML aliases (`*name`), each read as a copy of its anchor, make {total:,} "
                          f"values, more than the {MAX_EXPANDED_VALUES:,} a recipe may hold (aliases nested in "
                          "aliases multiply). Fix: write the values out, or use fewer levels of aliases.")


def unshared(node: Any, path: Path, _inside: tuple[int, ...] = ()) -> Any:
    """`node` with every mapping and list copied: PyYAML builds an anchor and its aliases as one shared object."""
    if not isinstance(node, (dict, list)):
        return node
    if id(node) in _inside:
        raise RecipeError(f"{path}: a YAML alias refers to a mapping or list that holds it (`&name` ... `*name` "
                          "inside it), which has no end. Fix: write the value out instead of the alias.")
    inside = (*_inside, id(node))
    if isinstance(node, dict):
        return {key: unshared(value, path, inside) for key, value in node.items()}
    return [unshared(value, path, inside) for value in node]
