"""Readers and the store builder on bad and good input: fail with file/line/field, or drop and count."""

import csv
import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from userdp.data import build_store, open_source
from userdp.data.records import EMPTY_TEXT, USERS_WITHOUT_RECORDS
from userdp.data.sources import BLANK_LINES, Fields, detect_format
from userdp.errors import UserError


def write_jsonl(path, rows, gz=False):
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    if gz:
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


ROWS = [{"user": f"u{i % 5}", "text": f"text number {i}", "date": f"2020-01-{1 + i % 28:02d}"} for i in range(40)]


def build(tmp_path, src, name="store"):
    return build_store(src, tmp_path / name)


@pytest.mark.parametrize("gz", [False, True])
def test_jsonl_roundtrip_groups_users_in_dataset_order(tmp_path, gz):
    p = write_jsonl(tmp_path / ("a.jsonl.gz" if gz else "a.jsonl"), ROWS, gz)
    res = build(tmp_path, open_source(str(p), fields=Fields(date="date")))
    st = res.store
    assert st.num_users == 5 and st.num_records == 40
    got = {st.user_id(u): st.texts(u) for u in range(st.num_users)}
    for u in range(5):
        assert got[f"u{u}"] == [f"text number {i}" for i in range(u, 40, 5)]
    u0 = st.user_index()["u0"]
    assert st.dates(u0)[:2] == ["2020-01-01", "2020-01-06"]
    assert res.drops.counts == {}


def test_gzip_detected_from_bytes_not_name(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", ROWS, gz=True)  # gzip without .gz
    assert build(tmp_path, open_source(str(p))).store.num_records == 40


def test_missing_user_field_names_file_line_and_field(tmp_path):
    rows = ROWS[:3] + [{"author": "x", "text": "hi"}]
    p = write_jsonl(tmp_path / "a.jsonl", rows)
    with pytest.raises(UserError, match=r"a\.jsonl:line 4: missing user field 'user'.*author"):
        build(tmp_path, open_source(str(p)))
    assert not (tmp_path / "store").exists()  # no half-built store left behind


def test_missing_text_field_and_custom_fields(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"author": "x", "body": "hi"}, {"author": "y"}])
    with pytest.raises(UserError, match=r"line 2: missing text field 'body'"):
        build(tmp_path, open_source(str(p), fields=Fields("author", "body")))


def test_null_user_is_an_error(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"user": None, "text": "hi"}])
    with pytest.raises(UserError, match=r"line 1: the user field 'user' is empty or null"):
        build(tmp_path, open_source(str(p)))


def test_invalid_utf8_names_line(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(b'{"user": "a", "text": "ok"}\n{"user": "b", "text": "bad \xff\xfe"}\n')
    with pytest.raises(UserError, match=r"a\.jsonl:line 2: invalid UTF-8"):
        build(tmp_path, open_source(str(p)))


def test_not_json_names_line(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"user": "a", "text": "ok"}\n{"user": "b", "text": \n')
    with pytest.raises(UserError, match=r"line 2: not valid JSON"):
        build(tmp_path, open_source(str(p)))


def test_empty_and_whitespace_records_dropped_and_counted_with_users_left_empty(tmp_path):
    rows = [
        {"user": "a", "text": "keep"},
        {"user": "a", "text": "   \n\t"},
        {"user": "b", "text": ""},
        {"user": "c", "text": None},
        {"user": "c", "text": " "},
        {"user": "d", "text": "also keep"},
    ]
    p = tmp_path / "a.jsonl"
    p.write_text(
        "".join(json.dumps(r) + "\n" for r in rows[:3]) + "\n" + "".join(json.dumps(r) + "\n" for r in rows[3:])
    )
    res = build(tmp_path, open_source(str(p)))
    assert res.store.num_records == 2 and sorted(res.store.user_ids) == ["a", "d"]
    assert res.drops.get(EMPTY_TEXT) == 4
    assert res.drops.get(USERS_WITHOUT_RECORDS) == 2  # b and c
    assert res.drops.get(BLANK_LINES) == 1
    assert "a.jsonl:line 2" in res.drops.examples[EMPTY_TEXT][0]
    # the counts survive in the store's metadata
    from userdp.data.store import UserStore

    assert UserStore(res.store.path).drops.get(EMPTY_TEXT) == 4


def test_all_records_empty_is_an_error(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"user": "a", "text": " "}])
    with pytest.raises(UserError, match="no records left"):
        build(tmp_path, open_source(str(p)))


def write_csv(path, header, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def test_csv_with_multiline_fields(tmp_path):
    p = write_csv(
        tmp_path / "a.csv", ["id", "user", "text"], [[1, "a", "line one\nline two"], [2, "b", "x"], [3, "a", "y"]]
    )
    st = build(tmp_path, open_source(str(p))).store
    assert st.texts(st.user_index()["a"]) == ["line one\nline two", "y"]


def test_csv_header_lacking_field(tmp_path):
    p = write_csv(tmp_path / "a.csv", ["author", "text"], [["a", "x"]])
    with pytest.raises(
        UserError, match=r"a\.csv:line 1: the CSV header lacks the user field 'user' \(header: author, text"
    ):
        build(tmp_path, open_source(str(p)))


def test_csv_short_row_and_bad_utf8(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("user,text\na,hello\nb\n")
    with pytest.raises(UserError, match=r"a\.csv:line 3: .*no value for the text field"):
        build(tmp_path, open_source(str(p)))
    p.write_bytes(b"user,text\na,hello\nb,\xff\n")
    with pytest.raises(UserError, match=r"a\.csv:line 3, byte 3: invalid UTF-8"):
        build(tmp_path, open_source(str(p)), name="s2")


def test_parquet_and_missing_column(tmp_path):
    t = pa.table({"who": ["a", "b", "a", "c"], "body": ["x", "y", "", "z"], "n": [1, 2, 3, 4]})
    pq.write_table(t, tmp_path / "a.parquet")
    res = build(tmp_path, open_source(str(tmp_path / "a.parquet"), fields=Fields("who", "body")))
    assert res.store.num_records == 3 and res.drops.get(EMPTY_TEXT) == 1
    assert "a.parquet:row 2" in res.drops.examples[EMPTY_TEXT][0]
    with pytest.raises(UserError, match=r"a\.parquet: no user field 'user' \(columns: who, body, n"):
        build(tmp_path, open_source(str(tmp_path / "a.parquet")), name="s2")


def test_parquet_integer_users(tmp_path):
    pq.write_table(pa.table({"user": [3, 1, 3], "text": ["a", "b", "c"]}), tmp_path / "a.parquet")
    st = build(tmp_path, open_source(str(tmp_path / "a.parquet"))).store
    assert sorted(st.user_ids) == ["1", "3"] and st.texts(st.user_index()["3"]) == ["a", "c"]


def test_hf_saved_dataset(tmp_path):
    import datasets

    ds = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"user": ["a", "b", "a"], "text": ["1", "2", "3"]}),
            "test": datasets.Dataset.from_dict({"user": ["z"], "text": ["9"]}),
        }
    )
    ds.save_to_disk(str(tmp_path / "ds"))
    assert detect_format(str(tmp_path / "ds")) == "hf"
    st = build(tmp_path, open_source(str(tmp_path / "ds"))).store
    assert st.num_users == 2 and st.texts(st.user_index()["a"]) == ["1", "3"]
    st = build(tmp_path, open_source(str(tmp_path / "ds"), split="test"), name="s2").store
    assert st.user_ids == ["z"]
    with pytest.raises(UserError, match="split"):
        build(tmp_path, open_source(str(tmp_path / "ds"), split="nope"), name="s3")


def test_format_detection_and_errors(tmp_path):
    assert detect_format("shakespeare") == "shakespeare"
    p = tmp_path / "data.txt"
    p.write_text('{"user": "a", "text": "b"}\n')
    assert detect_format(str(p)) == "jsonl"
    q = tmp_path / "blob.bin"
    q.write_text("hello")
    with pytest.raises(UserError, match="pass --format"):
        detect_format(str(q))
    with pytest.raises(UserError, match="does not exist"):
        open_source(str(tmp_path / "missing.jsonl"))


def test_text_not_a_string_and_missing_date(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", [{"user": "a", "text": "ok"}, {"user": "a", "text": 42}])
    with pytest.raises(UserError, match=r"line 2: the text field 'text' must be a string, got int"):
        build(tmp_path, open_source(str(p)))
    p = write_jsonl(tmp_path / "b.jsonl", [{"user": "a", "text": "ok", "d": "2020-01-01"}, {"user": "a", "text": "x"}])
    with pytest.raises(UserError, match=r"b\.jsonl:line 2: missing date field 'd'"):
        build(tmp_path, open_source(str(p), fields=Fields(date="d")), name="s2")


def test_parquet_binary_text_invalid_utf8(tmp_path):
    t = pa.table({"user": ["a", "b"], "text": pa.array([b"fine", b"bad \xff"], pa.binary())})
    pq.write_table(t, tmp_path / "a.parquet")
    with pytest.raises(UserError, match=r"a\.parquet:row 1: field 'text' is invalid UTF-8"):
        build(tmp_path, open_source(str(tmp_path / "a.parquet")))
