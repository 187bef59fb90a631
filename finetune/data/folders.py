"""Which files of a local folder are a dataset's rows: a hub README's `configs:` (subset and split pick them, as
`datasets` picks them), else every data file, split by name only where the names give two or more splits."""

from __future__ import annotations

from pathlib import Path

from finetune.data.readers import FOLDER_SUFFIXES, data_suffix, reason
from finetune.errors import DataError
from finetune.recipe import DatasetSpec

# Never rows, to `datasets` either (its FILES_TO_IGNORE): a hub download's card and metadata beside its data files.
NOT_DATA = frozenset({"README.md", "config.json", "dataset_info.json", "dataset_infos.json", "dummy_data.zip",
                      "dataset_dict.json"})
# the keys of a README config that finetune follows; `features` only types what the files' own types already give
READ_KEYS = frozenset({"data_files", "data_dir", "default", "features"})
TYPES = ", ".join(FOLDER_SUFFIXES[:-1]) + " or " + FOLDER_SUFFIXES[-1]


def saved_folder(path: Path) -> bool:
    """A `datasets.save_to_disk` folder, as `datasets.load_from_disk` tells one: a Dataset's dataset_info.json with its
    state.json, or a DatasetDict's dataset_dict.json. A hub download's dataset_info.json alone is metadata."""
    return ((path / "dataset_info.json").is_file() and (path / "state.json").is_file()) or (
        path / "dataset_dict.json").is_file()


def folder_files(path: Path, spec: DatasetSpec) -> list[Path]:
    """The data files of a folder that is not a save_to_disk folder, by path. A README.md whose YAML front matter has
    `configs:` (a hub dataset's card: gsm8k's main/ and socratic/, ultrafeedback's train_prefs) names them per config
    and split, and data.datasets[].subset and split pick one, as `datasets.load_dataset` did. Otherwise every data file
    is read; names choose a split only where they give two or more (a hub download's data/train-*.parquet and
    data/test-*.parquet), and then each file must be of one: `datasets`' guessing read train.jsonl alone of
    train.jsonl, batch2.jsonl and batch3.jsonl."""
    configs = _readme_configs(path)
    if configs:
        return _config_files(path, spec, configs)
    if spec.subset is not None:
        raise DataError(f"{path}: data.datasets[].subset `{spec.subset}` names a configuration, and the folder has no "
                        "README.md listing `configs:`; a local folder without one is read whole. Point the path at the "
                        "subset's own folder or file instead.")
    return _all_files(path, spec)


def _all_files(path: Path, spec: DatasetSpec) -> list[Path]:
    # hidden files and folders (a hub download's .cache) are not data, to `datasets` either
    found = sorted((file for file in path.rglob("*") if file.is_file() and not any(
        part.startswith((".", "__")) for part in file.relative_to(path).parts)), key=lambda file: file.relative_to(path).as_posix())
    files = [file for file in found if data_suffix(file) and file.name not in NOT_DATA]
    if any(data_suffix(file) != ".txt" for file in files):  # a notes.txt beside the data is no rows ...
        files = [file for file in files if data_suffix(file) != ".txt"]  # ... as `datasets` chose one builder
    if not files:
        raise DataError(f"{path}: a folder with no {TYPES} data files "
                        f"({'it holds ' + _named(path, found) if found else 'it is empty'}). Point data.datasets[].path "
                        "at a data file or a folder of them, or a `datasets.save_to_disk` folder.")
    splits = _named_splits(path, files)
    if len(splits) < 2:
        if spec.split not in ("train", *splits):
            raise DataError(f"{path}: split `{spec.split}` not found: the folder's files ({_named(path, files)}) name "
                            "no other split, and are read whole as one. Remove data.datasets[].split, or point the "
                            "path at the split's own files.")
        return files
    left = [file for file in files if not any(file in group for group in splits.values())]
    if left:
        raise DataError(f"{path}: the file names give splits ({', '.join(sorted(splits))}), and reading split "
                        f"`{spec.split}` would leave out the data files named after none: {_named(path, left)}. Fix: "
                        "rename them after a split (e.g. train-2.jsonl), move them out, or give each its own "
                        "data.datasets entry.")
    if spec.split not in splits:
        raise DataError(f"{path}: split `{spec.split}` not found (the file names give {', '.join(sorted(splits))}); "
                        "set data.datasets[].split.")
    return [file for file in files if file in splits[spec.split]]


def _named(path: Path, group: list[Path]) -> str:
    return ", ".join(file.relative_to(path).as_posix() for file in group[:8]) + (
        f" and {len(group) - 8} more" if len(group) > 8 else "")


def _named_splits(path: Path, files: list[Path]) -> dict[str, set[Path]]:
    """Split -> the files its name patterns match, by `datasets`' own rules (train/test/validation and their
    synonyms as a word of the name, `SPLIT-00000-of-00003` shards). A folder whose names give no split: {}."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        resolved = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    except Exception:  # noqa: BLE001  `datasets` found nothing it reads: no split names either
        return {}
    ours = {file.resolve(): file for file in files}  # `datasets` gives absolute paths
    splits = {str(name): {ours[found] for found in map(Path, group) if found in ours} for name, group in resolved.items()}
    return {name: group for name, group in splits.items() if group}


# ------------------------------------------------------------------------------------- a hub README's configs
def _readme_configs(path: Path) -> dict[str, dict]:
    """Config name -> its parameters (data_files, data_dir, default, ...), read from README.md's YAML front matter by
    `datasets`' own parser (MetadataConfigs, the same in datasets 4 and 5); {} without a README or `configs:`."""
    readme = path / "README.md"
    if not readme.is_file():
        return {}
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    try:
        return dict(MetadataConfigs.from_dataset_card_data(DatasetCard.load(readme).data))
    except Exception as exc:  # noqa: BLE001  YAML errors, a config without config_name, data_files of a wrong shape
        raise DataError(f"{readme}: its YAML front matter cannot be read as a dataset card's `configs:` "
                        f"({reason(exc)}). Fix the README's `configs:` (see the hub's dataset card docs), or remove "
                        "them to read every data file of the folder.") from None


def _config(path: Path, spec: DatasetSpec, configs: dict[str, dict]) -> tuple[str, dict]:
    """The config data.datasets[].subset names, else the card's default (the only one, `default`, or `default: true`)."""
    names = ", ".join(configs)
    if spec.subset is not None:
        if spec.subset not in configs:
            raise DataError(f"{path}: subset `{spec.subset}` not found: its README.md lists the configs {names}. Set "
                            "data.datasets[].subset to one of them.")
        return spec.subset, configs[spec.subset]
    defaults = [name for name, params in configs.items()
                if len(configs) == 1 or name == "default" or params.get("default")]
    if len(defaults) != 1:
        raise DataError(f"{path}: its README.md lists the configs {names} and "
                        f"{'marks none' if not defaults else 'marks several'} as the default. Set "
                        "data.datasets[].subset to the one to read.")
    return defaults[0], configs[defaults[0]]


def _config_files(path: Path, spec: DatasetSpec, configs: dict[str, dict]) -> list[Path]:
    """The files of the chosen config's split, resolved by `datasets`' own pattern rules (globs from the folder;
    README.md, dataset_info(s).json and hidden files never match), read in their order by finetune's readers. A
    config with a data_dir and no data_files reads that folder as any other."""
    from datasets.data_files import DataFilesList, sanitize_patterns

    name, params = _config(path, spec, configs)
    where = f"{path}: config `{name}` of its README.md"
    unread = sorted(set(params) - READ_KEYS)
    if unread:
        raise DataError(f"{where} sets `{unread[0]}`, which finetune's readers do not apply (they read data_files and "
                        "data_dir; a file's own types stand for features), so its rows would be read otherwise than "
                        "`datasets` reads them. Fix: convert the files (e.g. to JSON Lines) and point "
                        "data.datasets[].path at them.")
    if params.get("data_files") is None:
        return _all_files(path / params["data_dir"], spec) if params.get("data_dir") else _all_files(path, spec)
    patterns = sanitize_patterns(params["data_files"])
    if spec.split not in patterns:
        raise DataError(f"{where} has no split `{spec.split}` (its splits: {', '.join(patterns)}). Set "
                        "data.datasets[].split to one of them.")
    base = (path / params.get("data_dir", "")).resolve()
    try:
        found = [Path(file) for file in DataFilesList.from_patterns(patterns[spec.split], base_path=str(base))]
    except FileNotFoundError:
        found = []
    if not found:
        raise DataError(f"{where}: split `{spec.split}` names {', '.join(patterns[spec.split])}, and no file in "
                        f"{base} matches. Download the split's files, or fix the README's `data_files`.")
    inside = [path / file.relative_to(path.resolve()) for file in found if file.is_relative_to(path.resolve())]
    wrong = [file for file in inside if data_suffix(file) is None] + [file for file in found
                                                                      if not file.is_relative_to(path.resolve())]
    if wrong:
        raise DataError(f"{where}: split `{spec.split}` names {wrong[0]}, which finetune cannot read (data files "
                        f"are {TYPES}, inside the folder). Convert it, or point data.datasets[].path at data files.")
    return list(dict.fromkeys(inside))
