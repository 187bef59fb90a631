"""Parquet and Arrow files written by `datasets` >= 4.7, whose nested fields with keys that differ between rows are its
`Json` feature (JSON text in an `arrow.json` column, named in the schema's `huggingface` metadata): read as the objects
`datasets.load_dataset` gives (the oracle), cached and streaming, and rendered as objects in the chat template.

Found by a bug bash (37, finding 1): finetune's own reader (readers.batch_rows, Arrow's to_pylist) ignored the
metadata, so every Json value arrived as its JSON text: a tool's `properties` trained as an escaped string (silent),
and a `messages` column stored as List(Json) was refused with a `columns:` fix that could not work."""

from __future__ import annotations

import json
import shutil

import pytest
from chat_families import family_tokenizer

from finetune import data
from finetune.data.sources import load_rows
from finetune.data.streaming import dataset_rows
from finetune.errors import DataError
from finetune.recipe import DatasetSpec

datasets = pytest.importorskip("datasets")
if not hasattr(datasets, "Json"):
    pytest.skip("datasets < 4.7 writes no Json feature", allow_module_level=True)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
STOCK = {"type": "function", "function": {"name": "get_stock", "description": "Stock price", "parameters": {
    "type": "object", "properties": {"ticker": {"type": "string"}}, "required": ["ticker"]}}}


def call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def chat(question: str, tool: dict, arguments: dict, *, uniform: bool) -> dict:
    """A tool-calling row; `uniform`: every message has `tool_calls` (null but on the call) and the arguments are JSON
    text, so only the tools' `properties` differ between rows (Json); else only the call has `tool_calls` and the
    messages are List(Json)."""
    name = tool["function"]["name"]
    extra = {"tool_calls": None} if uniform else {}
    messages = [{"role": "user", "content": question, **extra},
                {"role": "assistant", "content": "", "tool_calls": [
                    call(name, json.dumps(arguments) if uniform else arguments)]},
                {"role": "tool", "content": "ok", **extra}, {"role": "assistant", "content": "Done.", **extra}]
    return {"messages": messages, "tools": [tool]}


def tool_rows(uniform: bool) -> list[dict]:
    return [chat("Weather in Paris?", WEATHER, {"city": "Paris"}, uniform=uniform),
            chat("AAPL price?", STOCK, {"ticker": "AAPL"}, uniform=uniform)] * 2


def write_as_datasets_does(tmp_path, rows: list[dict], suffix: str):
    """The rows through `datasets.load_dataset("json")` (which types the fields whose keys differ as Json, as for a
    push_to_hub) into a .parquet file (`to_parquet`) or an .arrow file (the IPC stream save_to_disk writes)."""
    tmp_path.mkdir(exist_ok=True)
    source = tmp_path / "src.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = datasets.load_dataset("json", data_files=str(source), split="train", cache_dir=str(tmp_path / "hf"))
    (tmp_path / "data").mkdir()
    path = tmp_path / "data" / f"train{suffix}"
    if suffix == ".parquet":
        loaded.to_parquet(str(path))
    else:
        loaded.save_to_disk(str(tmp_path / "saved"))
        shutil.copy(next((tmp_path / "saved").glob("*.arrow")), path)
    return loaded.features, path


def as_ipc_file(path) -> None:
    """The Arrow IPC stream at `path` rewritten as an Arrow IPC file (the other form an .arrow file may take)."""
    import pyarrow.ipc

    table = pyarrow.ipc.open_stream(path.read_bytes()).read_all()
    with pyarrow.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)


def oracle(path, tmp_path) -> list[dict]:
    builder = "parquet" if path.suffix == ".parquet" else "arrow"
    return list(datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=str(tmp_path / "hf2")))


@pytest.mark.parametrize("suffix", [".parquet", ".arrow", "arrow-file"])
@pytest.mark.parametrize("uniform", [True, False], ids=["tools-properties-json", "messages-list-json"])
def test_json_features_read_as_load_dataset_reads_them(tmp_path, uniform, suffix):
    """Found by a bug bash: a Json value (the tools' differing `properties`; the messages of which only some have
    `tool_calls`) was read as its JSON text, where `load_dataset` gives the object. Now the rows equal the oracle's,
    read whole and streamed, and from row 2 on (a resume); .arrow files as IPC streams and as IPC files."""
    features, path = write_as_datasets_does(tmp_path, tool_rows(uniform), ".arrow" if suffix == "arrow-file" else suffix)
    if suffix == "arrow-file":
        as_ipc_file(path)
    assert "Json" in str(features["tools"] if uniform else features["messages"])  # what the bug bash saw written
    expected = oracle(path, tmp_path)
    spec = DatasetSpec(path=str(path.parent), format="chat")
    assert load_rows(spec) == expected
    assert [item for _, item, _ in dataset_rows(spec)] == expected
    assert [item for _, item, _ in dataset_rows(spec, start=1)] == expected[1:]
    assert expected[1]["tools"][0]["function"]["parameters"]["properties"] == {"ticker": {"type": "string"}}


def test_json_schema_renders_as_an_object_and_messages_are_not_refused(tmp_path):
    """Found by a bug bash: the schema was rendered `"properties": "{\\"city\\": ...}"` (trained as an escaped
    string), and a List(Json) messages column was refused ("message 1 needs `role` and `content`")."""
    tokenizer = family_tokenizer("qwen3")
    spec = DatasetSpec(path="rows", format="chat")
    for uniform in (True, False):
        _, path = write_as_datasets_does(tmp_path / str(uniform), tool_rows(uniform), ".parquet")
        row = load_rows(DatasetSpec(path=str(path), format="chat"))[0]
        examples = data.tokenize_many(data.render_examples(row, spec, tokenizer, None, "row 1"), tokenizer)
        text = tokenizer.decode(examples[-1].input_ids)
        assert '"properties": {"city": {"type": "string"}}' in text, text
        assert '"arguments": {"city": "Paris"}' in text, text


def test_files_without_json_features_are_read_as_arrow_stores_them(tmp_path):
    """A file `datasets` wrote without Json (every row of one shape), and one pyarrow wrote: no decoders (no cost per
    row), rows as Arrow gives them; JSON text in a plain string column stays text."""
    import pyarrow
    import pyarrow.parquet

    from finetune.data.readers import json_decoders

    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "{\"a\": 1}"}]}] * 2
    plain = tmp_path / "plain.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(plain))
    table = pyarrow.Table.from_pylist([{"tools": json.dumps([WEATHER])}])
    pyarrow.parquet.write_table(table, tmp_path / "text.parquet")
    for path in (plain, tmp_path / "text.parquet"):
        assert json_decoders(pyarrow.parquet.ParquetFile(path).schema_arrow, path) == {}
    assert load_rows(DatasetSpec(path=str(plain), format="chat")) == rows
    assert load_rows(DatasetSpec(path=str(tmp_path / "text.parquet"), format="chat")) == [{"tools": json.dumps([WEATHER])}]


def test_json_column_holding_text_that_is_not_json_is_refused_naming_the_row(tmp_path):
    """A column the metadata types Json whose text is not JSON (not as `datasets` wrote it): a DataError naming the
    file, the row and the column, not a traceback."""
    import pyarrow
    import pyarrow.parquet

    path = tmp_path / "train.parquet"
    texts = pyarrow.ExtensionArray.from_storage(pyarrow.json_(), pyarrow.array(['{"role": "user"}', "{broken"]))
    messages = pyarrow.ListArray.from_arrays(pyarrow.array([0, 1, 2], pyarrow.int32()), texts)
    table = pyarrow.table({"messages": messages}).replace_schema_metadata({b"huggingface": json.dumps(
        {"info": {"features": {"messages": {"feature": {"_type": "Json"}, "_type": "List"}}}}).encode()})
    pyarrow.parquet.write_table(table, path)
    with pytest.raises(DataError, match=r"train\.parquet row 2: column `messages` is typed Json .* not JSON"):
        load_rows(DatasetSpec(path=str(path), format="chat"))
