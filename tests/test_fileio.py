"""One way to write a file (issue 26): atomic, one line on failure, nothing half-written left,
no input overwritten; and the CLI's cache and output paths that are files, links or unwritable."""

import errno
import os

import pytest

from userdp import fileio
from userdp.cli import main
from userdp.errors import UserError


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


def test_write_atomic_replaces_whole_and_makes_parents(tmp_path):
    p = tmp_path / "a" / "b" / "f.json"
    fileio.write_json(p, {"x": float("inf")})
    assert p.read_text() == '{\n  "x": "inf"\n}\n'
    fileio.write_atomic(p, b"new")
    assert p.read_bytes() == b"new" and _leftovers(p.parent) == []
    fileio.write_atomic(p, lambda path: open(path, "w").write("by callable"))
    assert p.read_text() == "by callable"


@pytest.mark.parametrize(
    "code, words",
    [
        (errno.ENOSPC, "the disk is full"),
        (errno.EROFS, "a read-only file system"),
        (errno.EACCES, "permission denied"),
        (errno.EDQUOT, "quota"),
    ],
)
def test_a_failed_write_keeps_the_old_file_leaves_no_temporary_and_is_one_line(tmp_path, monkeypatch, code, words):
    p = tmp_path / "state.json"
    p.write_text("old")

    def fail(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fileio.os, "fsync", fail)
    with pytest.raises(UserError) as e:
        fileio.write_atomic(p, "new content")
    assert str(e.value).startswith(f"{p}: cannot write it ({fileio._REASONS[code]}") and words in str(e.value)
    assert str(e.value).endswith(" MB free there)" if code in (errno.ENOSPC, errno.EDQUOT) else ")")
    assert "\n" not in str(e.value)
    assert p.read_text() == "old" and _leftovers(tmp_path) == []


def test_a_callable_writer_that_fails_leaves_nothing(tmp_path):
    def half(path):
        open(path, "w").write("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UserError, match="the disk is full"):
        fileio.write_atomic(tmp_path / "m.bin", half)
    assert list(tmp_path.iterdir()) == []


def test_a_file_where_a_folder_is_expected_and_a_dangling_link_are_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="a file is where a folder is expected"):
        fileio.write_atomic(tmp_path / "file" / "sub" / "f.json", "{}")
    with pytest.raises(UserError, match="cannot make this folder"):
        fileio.make_dir(tmp_path / "file" / "sub")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UserError, match="dangling symbolic link"):
        fileio.write_atomic(tmp_path / "link", "{}")
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "dir").mkdir()
    with pytest.raises(UserError, match="a folder is where a file is expected"):
        fileio.write_atomic(tmp_path / "dir", "{}")


def test_an_input_of_the_command_is_never_overwritten(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text("training:\n  steps: 3\n")
    fileio.forget_inputs()
    fileio.note_input(p)
    try:
        with pytest.raises(UserError, match="is an input of this command"):
            fileio.write_atomic(tmp_path / "." / "config.yaml", "overwritten")
        assert p.read_text() == "training:\n  steps: 3\n"
    finally:
        fileio.forget_inputs()
    fileio.write_atomic(p, "now allowed")  # a new command
    assert p.read_text() == "now allowed"


def test_atomic_dir_renames_when_whole_and_removes_the_temporary_on_failure(tmp_path):
    target = tmp_path / "cache" / "entry"
    with pytest.raises(RuntimeError):
        with fileio.atomic_dir(target) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("interrupted")
    assert not target.exists() and _leftovers(tmp_path / "cache") == []
    with fileio.atomic_dir(target) as tmp:
        (tmp / "a").write_text("1")
    assert (target / "a").read_text() == "1"
    with fileio.atomic_dir(target) as tmp:  # another process's entry is kept
        (tmp / "a").write_text("2")
    assert (target / "a").read_text() == "1" and _leftovers(tmp_path / "cache") == []
    with fileio.atomic_dir(target, keep_existing=False) as tmp:
        (tmp / "a").write_text("3")
    assert (target / "a").read_text() == "3"


def test_atomic_dir_full_disk_is_one_line_naming_the_folder(tmp_path, monkeypatch):
    def fail(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "fsync", fail)
    with pytest.raises(UserError, match=r"entry: cannot write it \(the disk is full; [0-9.]+ MB free there\)"):
        with fileio.atomic_dir(tmp_path / "entry") as tmp:
            (tmp / "big").write_text("x" * 100)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_plan_save_refuses_to_overwrite_the_data_it_read(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("USERDP_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"user": "u{i % 6}", "text": "hello there number {i}"}}\n' for i in range(30)))
    before = data.read_bytes()
    cfg = tmp_path / "c.yaml"
    public = tmp_path / "public.txt"
    public.write_text("\n\n".join("some public words here " * 3 for _ in range(20)))
    cfg.write_text(
        f"data:\n  source: jsonl\n  path: {data}\n  public_path: {public}\n"
        "tokenizer:\n  vocab_size: 300\n  seq_len: 16\nmodel:\n  pretrain: false\n"
    )
    rc = main(["plan", str(cfg), "--compute-budget", "8", "--save", str(data)])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        rc == 2
        and err[-1] == f"userdp: error: {data}: is an input of this command; refusing to overwrite it (write elsewhere)"
    )
    assert data.read_bytes() == before


def test_cache_clear_refuses_a_symlinked_kind_and_removes_nothing(tmp_path, monkeypatch, capsys):
    root = tmp_path / "cache"
    (root / "tokenized").mkdir(parents=True)
    (root / "tokenized" / "t").write_text("private")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("not userdp's")
    (root / "stores").symlink_to(elsewhere)
    monkeypatch.setenv("USERDP_CACHE", str(root))
    assert main(["cache", "clear"]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert (elsewhere / "keep").exists() and (root / "tokenized" / "t").exists()


@pytest.mark.parametrize("how", ["cache-is-a-file", "home-is-a-file"])
def test_a_cache_that_cannot_be_a_folder_is_one_line(tmp_path, monkeypatch, capsys, how):
    (tmp_path / "f").write_text("x")
    if how == "cache-is-a-file":
        monkeypatch.setenv("USERDP_CACHE", str(tmp_path / "f"))
    else:
        monkeypatch.delenv("USERDP_CACHE", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path / "f"))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"user": "u{i}", "text": "hello there number {i}"}}\n' for i in range(8)))
    rc = main(
        [
            "train",
            "--set",
            "data.source=jsonl",
            "--set",
            f"data.path={data}",
            "--set",
            "model.pretrain=false",
            "--no-progress",
            "--output",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert err[-1].startswith("userdp: error: ") and "Traceback" not in "\n".join(err)
    assert "folder" in err[-1] or "a file is where" in err[-1]
    assert not (tmp_path / "run").exists()


def test_init_on_a_full_disk_leaves_no_config(tmp_path, monkeypatch, capsys):
    # it left a 0-byte config (issue 26)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"user": "u{i % 5}", "text": "a message number {i}"}}\n' for i in range(40)))
    real = fileio.os.fsync

    def full(fd):
        if "my.yaml" in os.path.basename(os.readlink(f"/proc/self/fd/{fd}")):  # the config's temporary
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(fileio.os, "fsync", full)
    assert main(["init", str(data), "--output", str(tmp_path / "my.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"userdp: error: {tmp_path / 'my.yaml'}: cannot write it (the disk is full; ")
    assert err[-1].endswith(" MB free there)")  # and how much space there is
    assert not (tmp_path / "my.yaml").exists() and _leftovers(tmp_path) == []
