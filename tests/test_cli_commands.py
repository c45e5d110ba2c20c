"""The ``kvstash`` commands a user meets: fast start without torch, help, health and verify, rm of a prefix in
use, warnings, and prefill progress."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from client import KVClient
from client.cli import build_parser, main
from client.cli_errors import EXIT_CONFLICT, EXIT_PROBLEMS
from client.cli_model import METHOD_HELP
from client.kvclient import UsageWarning
from store.errors import PrefixInUse

REPO = Path(__file__).resolve().parents[1]
DOC = "Report. The contract was signed by Grace Hopper in Arlington on 4 May. " * 4


@pytest.fixture()
def kv(tmp_path: Path, tiny_model_dir: Path) -> KVClient:
    return KVClient(home=tmp_path / "home", model=str(tiny_model_dir), device="cpu", progress=False)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def _cli(*args: str) -> tuple[int, object]:
    """Exit status and --json output of a model-free command in its own process (the test's client holds the
    store open: one LMDB environment per process)."""
    r = subprocess.run([sys.executable, "-m", "client.cli", *args, "--json"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    return r.returncode, json.loads(r.stdout)


def test_commands_without_a_model_import_no_torch(tmp_path: Path) -> None:
    home = str(tmp_path / "home")
    calls = [["ls", "--home", home], ["info", "c" * 32, "--home", home], ["rm", "c" * 32, "--home", home],
             ["verify", "c" * 32, "--home", home], ["store", "check", "--home", home],
             ["budget", "--prefill-len", "4096", "--fraction", "0.05", "--head-dim", "64"],
             ["generate", "--prefix", "c" * 32, "Q", "--temperature", "inf"], ["eval", "--task", "x", "--length", "1"],
             ["--help"], ["generate", "--help"], ["--version"]]
    r = _run("import sys, contextlib, io\nfrom client.cli import main\n"
             f"for argv in {calls!r}:\n"
             "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), "
             "contextlib.suppress(SystemExit):\n"
             "        main(argv)\n"
             "    assert 'torch' not in sys.modules and 'transformers' not in sys.modules, argv\n")
    assert r.returncode == 0, r.stderr[-2000:]


def _best_of(cmd: list[str], n: int = 3) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=120, check=True)
        best = min(best, time.perf_counter() - t0)
    return best


def test_help_starts_fast() -> None:
    """A generous bound on the start-up cost over a bare interpreter (``bench/bench_cli_startup.py`` measures it);
    importing torch alone costs more than this."""
    bare = _best_of([sys.executable, "-c", "pass"])
    cli = _best_of([sys.executable, "-m", "client.cli", "--help"])
    assert cli - bare < 0.8, (cli, bare)


def test_help_lists_methods_tasks_units_and_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    from lab.synth.registry import TASKS
    from workers.methods.registry import METHODS

    assert list(METHOD_HELP) == list(METHODS)  # the help's table follows the registry
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    assert all(f"\n  {m} " in text for m in METHODS) and "FRACTION" in text and "TOKENS" in text
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    assert all(t in text for t in TASKS)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "exit status:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("kvstash ")
    actions = {a.dest for p in (build_parser(),) for a in p._subparsers._group_actions[0].choices["ls"]._actions}
    assert "model" not in actions and "device" not in actions


def test_info_and_ls_tell_a_damaged_prefix_and_verify_reads_pages(kv: KVClient, tmp_path: Path) -> None:
    home = str(tmp_path / "home")
    good, bad, flipped = kv.prefill(DOC), kv.prefill(DOC + " More."), kv.prefill(DOC + " Other.")
    page_file = tmp_path / "home" / "prefixes" / bad.prefix_id / "layer_001.kv"
    page_file.write_bytes(page_file.read_bytes()[:-10])  # truncated: shows without reading the pages
    other = tmp_path / "home" / "prefixes" / flipped.prefix_id / "layer_000.kv"
    data = bytearray(other.read_bytes())
    data[100] ^= 0xFF  # same size, other bytes: only reading the pages finds it
    other.write_bytes(bytes(data))
    status, rows = _cli("ls", "--home", home)
    assert status == 0 and {r["prefix_id"]: r["status"] for r in rows} == {  # type: ignore[attr-defined]
        good.prefix_id: "ok", bad.prefix_id: "damaged", flipped.prefix_id: "ok"}
    status, info = _cli("info", bad.prefix_id, "--home", home)
    health = info["health"]  # type: ignore[index]
    assert status == 0 and health["ok"] is False and "layer_001.kv" in health["problem"] and not health["verified"]
    status, out = _cli("verify", flipped.prefix_id, "--home", home)
    assert status == EXIT_PROBLEMS and "checksum" in out["problem"]  # type: ignore[index]
    assert _cli("verify", good.prefix_id, "--home", home) == (0, {"prefix_id": good.prefix_id, "ok": True,
                                                                  "problem": None, "verified": True, "leases": 0})


def test_rm_refuses_a_prefix_in_use_unless_forced(kv: KVClient, tmp_path: Path) -> None:
    home = str(tmp_path / "home")
    doc = kv.prefill(DOC)
    gen = iter(kv.generate("Who signed it?", prefix=doc, max_new_tokens=4))
    next(gen)  # a generation under way holds a lease
    status, err = _cli("rm", doc.prefix_id, "--home", home)
    assert status == EXIT_CONFLICT and err["code"] == "FAILED_PRECONDITION"  # type: ignore[index]
    assert "in use" in err["error"] and "--force" in err["error"]  # type: ignore[index]
    with pytest.raises(PrefixInUse):
        kv.rm(doc.prefix_id, wait_s=0.6)
    list(gen)  # the generation ends: its lease goes
    assert _cli("rm", doc.prefix_id, "--home", home, "--wait", "5") == (0, {"removed": doc.prefix_id})
    again = kv.prefill(DOC)
    gen = iter(kv.generate("Who signed it?", prefix=again, max_new_tokens=4))
    next(gen)
    assert _cli("rm", again.prefix_id, "--home", home, "--force")[0] == 0
    assert kv.ls() == []


def test_warnings_for_legal_but_unlikely_requests(kv: KVClient, tmp_path: Path, tiny_model_dir: Path) -> None:
    doc = kv.prefill(DOC)
    with pytest.warns(UsageWarning, match="budget 0.1 is ignored"):
        assert isinstance(kv.generate("Who?", prefix=doc, budget=0.1, max_new_tokens=1).text, str)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UsageWarning)
        assert isinstance(kv.generate("Who?", prefix=doc, method="quest", budget=0.5, max_new_tokens=1).text, str)
    short = tmp_path / "short-model"
    short.mkdir()
    for f in tiny_model_dir.iterdir():
        (short / f.name).symlink_to(f)
    (short / "kvstash.json").write_text(json.dumps({"trained_context": 64}))
    trained_short = KVClient(home=tmp_path / "home2", model=str(short), device="cpu", progress=False)
    with pytest.warns(UsageWarning, match=r"trained on up to 64"):
        trained_short.prefill(DOC)


def test_prefill_progress_shows_every_phase_and_waits(kv: KVClient, capsys: pytest.CaptureFixture[str]) -> None:
    worker = kv.worker
    worker.progress = True
    pid = worker.prefix_key(worker.tokenize_document(DOC)).prefix_id
    result: list[bool] = []
    with worker.store.prefill_lock(pid):  # another prefill of this document holds it
        t = threading.Thread(target=lambda: result.append(worker.prefill(DOC).cached))
        t.start()
        time.sleep(1.0)
    t.join(60)
    err = capsys.readouterr().err
    assert result == [False]
    assert f"waiting for another prefill of this document (prefix {pid})" in err
    for phase in ("prefill 1/3 forward", "prefill 2/3 summaries + pages", "prefill 3/3 durable write"):
        assert phase in err
