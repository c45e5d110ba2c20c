"""Every failure of the ``kvstash`` CLI, run as a user runs it (a subprocess): one ``kvstash: error:`` line, a
stable exit status, a JSON error object under --json, never a traceback; and what it leaves on disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client.cli_errors import EXIT_INTERRUPTED, EXIT_NO_ROOM, EXIT_NOT_FOUND, EXIT_USAGE

REPO = Path(__file__).resolve().parents[1]


def _env(home: Path, model: Path | None) -> dict[str, str]:
    env = {**os.environ, "KVSTASH_HOME": str(home)}
    env.pop("KVSTASH_DEBUG", None)
    if model is not None:
        env["KVSTASH_MODEL"] = str(model)
    return env


def _cli(args: list[str], home: Path, model: Path | None = None, prefix: tuple[str, ...] = (),
         stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "client.cli", *args], cwd=REPO, env=_env(home, model),
                          capture_output=True, text=True, input=stdin, timeout=300)


def _one_error(r: subprocess.CompletedProcess, status: int, words: str) -> dict:
    """The run failed with ``status`` and one stderr line containing ``words``; returns its --json object."""
    assert r.returncode == status, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvstash: error: ") and words in lines[0], r.stderr
    err = json.loads(r.stdout)
    assert err["exit_status"] == status and err["error"] in lines[0] and err["code"]
    return err


ARGUMENT_ERRORS = [
    (["generate", "--prefix", "a" * 32, "Q?", "--temperature", "nan"], "finite"),
    (["generate", "--prefix", "a" * 32, "Q?", "--method", "bogus"], "invalid choice"),
    (["generate", "--prefix", "", "Q?"], "32 lowercase hex"),
    (["eval", "--task", "bogus", "--length", "100"], "invalid choice: 'bogus'"),
    (["eval", "--task", "niah_single", "--length", "100", "--samples", "0"], "--samples: must be at least 1"),
    (["eval", "--task", "niah_single", "--length", "100", "--concurrency", "257"], "concurrency must be 1 to 256"),
    (["info", ""], "32 lowercase hex"),
    (["rm", "a" * 32, "--model", "x"], "kvstash rm: unrecognized arguments: --model x"),
    (["ls", "--device", "cpu"], "kvstash ls: unrecognized arguments: --device cpu"),
    (["prefill", "/no/such/file.txt"], "no such file or directory: /no/such/file.txt"),
    (["prefill", "-", "--model", "/no/such/model"], "model path '/no/such/model' does not exist"),
    (["prefill", "-", "--device", "tpu"], "unknown device 'tpu'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize(("args", "words"), ARGUMENT_ERRORS, ids=[" ".join(a)[:40] for a, _ in ARGUMENT_ERRORS])
def test_bad_arguments_fail_in_one_line(tmp_path: Path, args: list[str], words: str) -> None:
    _one_error(_cli([*args, "--json"], tmp_path / "home", stdin="some text"), EXIT_USAGE, words)


def test_missing_prefix_is_not_found(tmp_path: Path) -> None:
    for args in (["info", "b" * 32], ["rm", "b" * 32], ["verify", "b" * 32]):
        assert _one_error(_cli([*args, "--json"], tmp_path / "home"), EXIT_NOT_FOUND, "no prefix")["code"] == \
            "NOT_FOUND"


def test_cuda_without_a_gpu_is_a_clean_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _one_error(_cli(["prefill", "-", "--device", "cuda", "--json"], tmp_path / "home", tiny_model_dir,
                    stdin="text"), EXIT_USAGE, "torch sees no CUDA GPU")


def test_usage_error_without_json_prints_no_usage_block(tmp_path: Path) -> None:
    r = _cli(["eval", "--task", "bogus", "--length", "5"], tmp_path / "home")
    assert r.returncode == EXIT_USAGE and r.stdout == "" and r.stderr.count("\n") == 1 and "usage:" not in r.stderr


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare -rm to mount a private tmpfs")
def test_disk_full_during_a_write_is_a_clean_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A real full disk (a small private tmpfs): the page bytes fit the pre-check, what follows them does not."""
    doc = "".join(chr(97 + (i * 7) % 26) for i in range(3000))  # 3000 tokens of the byte-level tiny model
    probe = tmp_path / "probe"
    r = _cli(["prefill", "-", "--json"], probe, tiny_model_dir, stdin=doc)
    assert r.returncode == 0, r.stderr
    kv_bytes = json.loads(_cli(["ls", "--json"], probe).stdout)[0]["kv_bytes"]
    home = tmp_path / "full"
    home.mkdir()
    seen = set()
    for extra_kib in (8, 64, 160):  # room for the pages, then less than the summaries or the metadata need
        size_kib = kv_bytes // 1024 + extra_kib
        script = f"mount -t tmpfs -o size={size_kib}k tmpfs {home} && exec \"$@\""
        r = _cli(["prefill", "-", "--json"], home, tiny_model_dir, prefix=("unshare", "-rm", "sh", "-c", script, "sh"),
                 stdin=doc)
        if r.returncode == 0:
            continue
        err = _one_error(r, EXIT_NO_ROOM, "")
        assert err["code"] == "RESOURCE_EXHAUSTED"
        seen.add("pre-check" if "does not fit" in err["error"] else "during the write")
    assert "during the write" in seen, seen  # at least one size ran out of space mid-write
    assert not home.exists() or not any(home.iterdir())  # the tmpfs was private: nothing leaked out


@pytest.mark.slow
def test_ctrl_c_exits_130_in_one_line_and_leaves_nothing(tmp_path: Path, endless_model_dir: Path) -> None:
    home = tmp_path / "home"
    doc = "".join(chr(97 + (i * 7) % 26) for i in range(24000))  # a prefill of several seconds on a CPU
    docfile = tmp_path / "doc.txt"
    docfile.write_text(doc)
    p = subprocess.Popen([sys.executable, "-m", "client.cli", "prefill", str(docfile)], cwd=REPO,
                         env=_env(home, endless_model_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list((home / "prefixes").glob(".tmp-*")):
        time.sleep(0.05)  # until the write has begun
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    if p.returncode == 0:
        pytest.skip("the prefill finished before the signal")
    assert p.returncode == EXIT_INTERRUPTED, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["kvstash: interrupted; nothing was left half-written"], err[-2000:]
    assert out == "" and sorted(p.name for p in (home / "prefixes").iterdir()) == []
