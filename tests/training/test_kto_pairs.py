"""KTO on a pair file (prompt/chosen/rejected): unpaired as TRL 1.16's KTOTrainer unpairs it.

Found by bug bashes (bb47 #1, bb51 #8): under `train.objective: kto` a DPO pair file was refused. Given as
`format: unpaired_preference` the error named SFT formats (alpaca | chat | completion | text), each refused under kto;
given as `format: preference` the recipe's hint said "a pair file unpairs into one desirable and one undesirable row per
pair", as if finetune unpaired it, and following it led to the first error. TRL's KTOTrainer unpairs such a dataset
itself (data_utils.unpair_preference_dataset, after extract_prompt for the implicit-prompt form): now finetune does too,
and says so in the data line and in `finetune data`.

The oracle is TRL's own code: its unpaired rows, written as a KTO file, train the same tokens, labels, desirable flags
and KL rows, in the same order, as the pair file does.
"""

from __future__ import annotations

import pytest
import torch
from conftest import objective_recipe, read_metrics, write_jsonl, write_recipe
from test_preference import _train

from finetune import data, model
from finetune.data import BatchStream
from finetune.data.sources import _check_first_lines
from finetune.errors import DataError, RecipeError
from finetune.recipe import DatasetSpec, validate_recipe

SKY = [{"role": "user", "content": "What colour is the sky?"}]
PAIR_FILES = {
    "text": [{"prompt": f"What is {i} plus {i}?", "chosen": f"{2 * i}.", "rejected": f"{2 * i + 1}.",
              "system": "Answer with a number."} for i in range(6)],
    "messages": [{"prompt": SKY, "chosen": [{"role": "assistant", "content": f"Blue, {i}."}],
                  "rejected": [{"role": "assistant", "content": f"Green, {i}."}]} for i in range(5)],
    "implicit prompt": [{"chosen": [*SKY, {"role": "assistant", "content": f"Blue {i}"}],
                         "rejected": [*SKY, {"role": "assistant", "content": f"Red {i}"}]} for i in range(5)],
}


def trl_unpaired(rows: list[dict]) -> list[dict]:
    """What TRL 1.16's KTOTrainer._prepare_dataset makes of `rows` before tokenizing: the prompt extracted where the
    rows have none, then unpair_preference_dataset."""
    from datasets import Dataset
    from trl.data_utils import extract_prompt, unpair_preference_dataset

    dataset = Dataset.from_list(rows)
    if "prompt" not in dataset.column_names:
        dataset = dataset.map(extract_prompt)
    return unpair_preference_dataset(dataset).to_list()


def _prepared(tiny_llama, path, data_format: str, tmp_path, **data_keys):
    values = objective_recipe("kto", data_format, tiny_llama, path, tmp_path / "out")
    values["data"].update({"eval_fraction": 0.0, "cache": False, **data_keys})
    recipe = validate_recipe(values)
    tokenizer = model.load_tokenizer(recipe)
    data.check_local_files(recipe)  # the pre-flight check of the first lines (it refused the pair file before)
    return data.prepare(recipe, tokenizer), recipe, tokenizer


def _batches(examples, count: int = 3) -> list[dict]:
    """The first micro-batches a KTO run takes of `examples`, their KL rows included (BatchStream)."""
    stream = iter(BatchStream(examples, micro_batch_size=4, rank=0, world_size=1, seed=0, pad_id=0, grad_accum=2,
                              kl_max_length=128))
    return [next(stream) for _ in range(count)]


@pytest.mark.parametrize("data_format", ["preference", "unpaired_preference"])
@pytest.mark.parametrize("kind", list(PAIR_FILES))
def test_a_pair_file_trains_as_the_rows_trls_unpairing_gives(tiny_llama, tmp_path, kind, data_format):
    """Before: refused (module docstring). Now the pair file gives exactly the examples of TRL's unpaired rows."""
    pairs = PAIR_FILES[kind]
    unpaired = trl_unpaired(pairs)
    assert [row["label"] for row in unpaired] == [True] * len(pairs) + [False] * len(pairs)  # TRL's order
    ours, recipe, _ = _prepared(tiny_llama, write_jsonl(tmp_path / "pairs.jsonl", pairs), data_format, tmp_path)
    theirs, _, _ = _prepared(tiny_llama, write_jsonl(tmp_path / "trl.jsonl", unpaired), "unpaired_preference", tmp_path)
    assert len(ours.train) == 2 * len(pairs)
    for mine, trl in zip(ours.train, theirs.train, strict=True):
        assert (mine.input_ids, mine.labels, mine.desirable) == (trl.input_ids, trl.labels, trl.desirable)
    for mine, trl in zip(_batches(ours.train), _batches(theirs.train)):  # the rows and their mismatched (KL) rows
        assert mine.keys() == trl.keys() and {"kl_input_ids", "desirable"} <= mine.keys()
        assert all(torch.equal(mine[key], trl[key]) for key in mine)
    # said in the data line and in `finetune data`'s notes, with the count
    line = data.data_line(ours.stats, recipe)
    assert (f"{len(pairs)} preference pairs (the first: {tmp_path / 'pairs.jsonl'} line 1) unpaired into "
            f"{2 * len(pairs)} KTO rows, as TRL's KTOTrainer does") in line
    assert "unpaired" not in data.data_line(theirs.stats, recipe)
    from finetune.cli.preview import render_preview

    preview = render_preview(ours, model.load_tokenizer(recipe), recipe, rows=1)  # what `finetune data` prints
    assert f"note: {len(pairs)} preference pairs" in preview and f"{len(pairs)} rows -> {2 * len(pairs)} examples" in preview
    assert ours.stats.per_dataset[0]["format"] == data_format  # as the recipe gives it


def test_pairs_past_a_thousand_are_unpaired_in_trls_order_and_the_cache_keeps_it(tiny_llama, tmp_path):
    """TRL maps its unpairing over batches of 1,000 rows (each batch's chosen rows, then its rejected rows): the rows
    of a file of 1,001 pairs come in that order, through the token cache too (its entry is KTO rows, not pairs)."""
    pairs = [{"prompt": f"{i}+{i}=", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}"} for i in range(1001)]
    expected = [(row["completion"], row["label"]) for row in trl_unpaired(pairs)]
    assert expected[999:1001] == [("1998", True), ("1", False)] and expected[2000:] == [("2000", True), ("2001", False)]
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    prepared, _, tokenizer = _prepared(tiny_llama, path, "preference", tmp_path, num_proc=1, cache=True)
    found = [(tokenizer.decode([i for i, label in zip(e.input_ids, e.labels) if label != -100][:-1]), e.desirable)
             for e in prepared.train]
    assert found == expected


def test_the_hints_name_what_kto_takes(tiny_llama, tmp_path):
    """Before: under kto, an SFT format's recipe hint said a pair file "unpairs" (it was refused), and a preference
    or KTO file missing its fields was told to set an SFT format (alpaca | chat | completion | text), each refused
    under kto. Now the recipe accepts pairs under kto, its hint says finetune unpairs them, and the missing-field
    hint names the formats of the file's kind."""
    values = objective_recipe("kto", "alpaca", tiny_llama, tmp_path / "x.jsonl", tmp_path / "out")
    with pytest.raises(RecipeError, match=r"format: preference, which finetune unpairs as TRL's KTOTrainer does"):
        validate_recipe(values)
    for data_format, rows, needle in (
            ("unpaired_preference", [{"question": "Q?", "answer": "A"}],
             (r"no row has the `prompt` field that format `unpaired_preference` needs.*\(preference: "
              r"prompt/chosen/rejected pairs.*kto, which unpairs them.*\| unpaired_preference: prompt/completion/label")),
            ("preference", [{"prompt": "Q?", "good": "A", "bad": "B"}], r"`chosen` field that format `preference`"),
            ("prompt", [{"question": "Q?"}], r"Format prompt \(train.objective grpo\) needs each row's `prompt`")):
        path = write_jsonl(tmp_path / "rows.jsonl", rows)
        with pytest.raises(DataError, match=needle) as error:  # (data.check_local_files' check of the first lines)
            _check_first_lines(path, DatasetSpec(path=str(path), format=data_format), "rows", bad_rows="error")
        assert "alpaca | chat" not in str(error.value)
    values = objective_recipe("kto", "unpaired_preference", tiny_llama, path, tmp_path / "out")
    with pytest.raises(DataError, match=r"format `unpaired_preference` needs.*kto, which unpairs them"):
        data.check_local_files(validate_recipe(values))  # through the run's pre-flight check


def test_a_mapped_pair_file_and_bad_pairs_under_kto(tiny_llama, tmp_path):
    """A pair file's columns map as under dpo (given as unpaired_preference too); a pair whose answers are the same is
    the row's error (it says nothing either way), skipped with data.bad_rows: skip."""
    rows = [{"question": "Q?", "better": "A", "worse": "B"}, {"question": "R?", "better": "C", "worse": "C"}]
    path = write_jsonl(tmp_path / "mapped.jsonl", rows)
    columns = {"prompt": "question", "chosen": "better", "rejected": "worse"}
    for data_format in ("preference", "unpaired_preference"):
        spec = {"path": str(path), "format": data_format, "columns": columns}
        with pytest.raises(DataError, match=r"line 2: `chosen` and `rejected` are identical"):
            _prepared(tiny_llama, path, data_format, tmp_path, datasets=[spec])
        prepared, _, _ = _prepared(tiny_llama, path, data_format, tmp_path, datasets=[spec], bad_rows="skip")
        assert [e.desirable for e in prepared.train] == [True, False] and prepared.stats.skipped == 1
    # one token cache for dpo and kto: the same pair file is pairs under dpo and KTO rows under kto, never the other's
    for objective, shape in (("dpo", (1, None, True)), ("kto", (2, True, False)), ("dpo", (1, None, True))):
        values = objective_recipe(objective, "preference", tiny_llama, path, tmp_path / "out")
        values["data"].update({"eval_fraction": 0.0, "bad_rows": "skip", "datasets": [
            {"path": str(path), "format": "preference", "columns": columns}]})
        recipe = validate_recipe(values)
        train = data.prepare(recipe, model.load_tokenizer(recipe)).train
        assert (len(train), train[0].desirable, train[0].rejected is not None) == shape


@pytest.mark.slow
def test_a_kto_run_on_a_pair_file_with_an_eval_fraction(tiny_llama, tmp_path):
    """A real run (one process) of `format: preference` under kto with data.eval_fraction: step 1 is 0.5 (policy =
    reference, default weights: every pair gives one row of each kind), the KL term goes live, the eval runs, and the
    data line says the pairs were unpaired."""
    pairs = [{"prompt": f"What is {a} plus {b}?", "chosen": f"{a + b}.", "rejected": f"{a + b + 1 + (a % 7)}."}
             for a, b in zip(range(0, 96, 3), range(40, 8, -1))]
    values = objective_recipe("kto", "preference", tiny_llama, write_jsonl(tmp_path / "pairs.jsonl", pairs),
                              tmp_path / "run", train={"max_steps": 6, "micro_batch_size": 8, "learning_rate": 2e-2,
                                                       "eval_every": 3}, data={"eval_fraction": 0.125})
    result = _train(write_recipe(tmp_path / "kto.yaml", values))
    assert "32 preference pairs (the first: " in result.stdout + result.stderr
    assert "unpaired into 64 KTO rows" in result.stdout + result.stderr
    logged = [m for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert logged[0]["loss"] == pytest.approx(0.5, abs=1e-6) and logged[0]["kl"] == 0
    assert len(logged) == 6 and all("kl" in m for m in logged)
    evals = [m for m in read_metrics(tmp_path / "run") if "eval_loss" in m]
    assert len(evals) == 2 and {"eval_kl", "eval_rewards/chosen", "eval_rewards/rejected"} <= set(evals[-1])
