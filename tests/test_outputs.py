"""Outputs: written whole or not at all, through symlinks, in place on FIFOs, devices and /dev/stdout, and
errors that name the path."""

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipesim.traces import write_atomic
from tests.conftest import pipesim, pipesim_fresh

EXPORT = ["export", "-s", "1f1b", "-p", "2", "-m", "2", "--format", "torch-csv"]
GRID = Path(__file__).resolve().parents[1] / "examples" / "grid.toml"
CSV = "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"


def test_a_regular_file_is_replaced_keeping_its_permissions(tmp_path):
    path = tmp_path / "out.csv"
    path.write_text("old")
    path.chmod(0o640)
    write_atomic(path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert os.listdir(tmp_path) == ["out.csv"]  # no temporary file left


def test_a_failed_write_leaves_nothing_and_names_the_path(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    path = tmp_path / "out.json"
    with pytest.raises(OSError) as exc:
        write_atomic(path, "data")
    assert (exc.value.filename, exc.value.strerror) == (str(path), "No space left on device")
    assert os.listdir(tmp_path) == []


def test_writing_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "zb.csv"
    target.write_text("0F0,0B0\n")  # an older schedule CSV: a file of another kind is refused
    link = tmp_path / "zb.csv"
    link.symlink_to(os.path.join("real", "zb.csv"))  # relative, as `ln -s` makes them
    code, out, err = pipesim(*EXPORT, "--out", link)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == os.path.join("real", "zb.csv")
    assert target.read_text() == CSV
    assert sorted(os.listdir(tmp_path / "real")) == ["zb.csv"] and f"wrote {link}" in out
    dangling = tmp_path / "new.csv"
    dangling.symlink_to(tmp_path / "real" / "made.csv")  # the link's target is created
    assert pipesim(*EXPORT, "--out", dangling).code == 0
    assert dangling.is_symlink() and (tmp_path / "real" / "made.csv").read_text() == CSV


def test_a_fifo_is_written_in_place(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()  # blocks in open() until a writer opens the FIFO
    code, _, err = pipesim("simulate", "-s", "1f1b", "--trace", fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # not replaced by a file
    try:  # a reader still waiting for a writer (none came): let it go
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader waiting: it has had what was written
        pass
    reader.join()
    assert code == 0, err
    assert json.loads(received[0])["traceEvents"]


def test_a_device_is_written_in_place_and_its_error_names_it():
    if not os.path.exists("/dev/full") or not os.access("/dev/full", os.W_OK):
        pytest.skip("no writable /dev/full here")
    for args in (["simulate", "-s", "1f1b", "--trace", "/dev/full"], ["simulate", "-s", "1f1b", "--html", "/dev/full"],
                 [*EXPORT, "--out", "/dev/full"], ["sweep", "-s", "1f1b", "--workers", "1", "--html", "/dev/full"]):
        code, _, err = pipesim(*args)
        assert (code, err) == (2, f"error: {args[-2]}: cannot write /dev/full: No space left on device\n"), args
        assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


@pytest.mark.parametrize("redirect", ["pipe", "file"])
def test_dev_stdout_is_written_in_place(tmp_path, redirect):
    """Also when stdout is a regular file: replacing it would lose what was printed around the write. What the
    command prints goes to stderr: the standard output holds the output alone, as a pipe reads it."""
    command = [sys.executable, "-c", "from pipesim.cli import main; main()", *EXPORT, "--out", "/dev/stdout"]
    if redirect == "pipe":
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        out, err = done.stdout, done.stderr
    else:
        with open(tmp_path / "stdout.txt", "w") as handle:
            err = subprocess.run(command, stdout=handle, stderr=subprocess.PIPE, text=True, check=True).stderr
        out = (tmp_path / "stdout.txt").read_text()
        assert os.listdir(tmp_path) == ["stdout.txt"]
    assert out == CSV and err == "wrote /dev/stdout\n"


def test_output_checks_before_any_work(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "missing" / "t.json")
    code, _, err = pipesim("simulate", "-s", "1f1b", "--trace", link)
    assert code == 2 and f"--trace: cannot write {link}: folder {tmp_path / 'missing'} does not exist" in err
    code, _, err = pipesim("simulate", "-s", "1f1b", "--html", tmp_path)
    assert code == 2 and "is a directory" in err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("args", [["simulate", "-s", "1f1b", "--html", "/proc/t.html"],
                                  ["simulate", "-s", "1f1b", "--trace", "/proc/t.html"],
                                  [*EXPORT, "--out", "/proc/t.html"],
                                  ["sweep", "--grid", GRID, "--html", "/proc/t.html"]])
def test_a_folder_that_takes_no_new_file_is_refused_before_any_work_even_for_root(args):
    """/proc takes no new file, root or not, though a permission check says yes to root: the output was refused
    by the write, once the work was done ("cannot write /proc/t.html: No such file or directory")."""
    flag = args[-2]
    code, out, err = pipesim(*args)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {flag}: cannot write /proc/t.html: folder /proc "), err


@pytest.mark.parametrize("command", [("calibrate", "--model", "mlp", "--stages", 2, "--out", "p.json"),
                                     ("run", "-s", "1f1b", "--model", "mlp", "--trace", "t.json"),
                                     ("study", "--seeds", 1, "-s", "1f1b", "--no-timing", "--results", "s.json")],
                         ids=lambda command: command[0])
def test_an_output_in_a_missing_folder_is_refused_before_torch_is_imported(command, tmp_path):
    """calibrate checked --model's torch (its import, 4-20 s on a busy host) before its --out: a path it could
    not write was refused only then."""
    missing = tmp_path / "missing"
    *flags, flag, name = command
    (done,), imported = pipesim_fresh((*flags, flag, missing / name), cwd=tmp_path)
    assert done == (2, "", f"error: {flag}: cannot write {missing / name}: folder {missing} does not exist\n")
    assert "torch" not in imported and not list(tmp_path.iterdir())
