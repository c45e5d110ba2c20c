"""Appendix-D budget accounting on the paper's worked numbers, and the ``kvstash budget`` command."""

from __future__ import annotations

import argparse
import json
from fractions import Fraction

import pytest

from client.cli_budget import add_budget_command
from workers.budget import (
    k_hyb,
    k_topk,
    n_budget,
    n_off,
    phi_once_bytes,
    phi_once_token_equiv,
    plan_budget,
    reads_per_step,
    token_bytes,
)


def test_qwen3_16k_one_percent_example() -> None:
    """Appendix D.5: N=16384, f=1%, d_h=d_phi=128 -> n=164, k_topk=144, R=65, k_hyb=79."""
    p = plan_budget(prefill_len=16384, fraction=0.01, head_dim=128, phi_dim=128)
    assert (p.n_budget, p.k_topk, p.r_phi_once, p.n_off, p.k_hyb) == (164, 144, 65.0, 65, 79)
    assert p.hybrid_feasible


def test_llama_ruler_16k_examples() -> None:
    """§6.4: k_hyb(3%) = 492 - 20 - 33 = 439 and k_topk(5%) = 820 - 20 = 800 (d_h=d_phi=64)."""
    assert plan_budget(prefill_len=16384, fraction=0.03, head_dim=64, phi_dim=64).k_hyb == 439
    assert plan_budget(prefill_len=16384, fraction=0.05, head_dim=64, phi_dim=64).k_topk == 800
    assert phi_once_token_equiv(64, 64) == 33


def test_one_time_fetch_in_bytes_and_token_equivalents() -> None:
    """R_once = B_phi,once / B_tok = (d_phi d_h + 2 d_phi) b / (2 d_h b) (eqs. 44, 46, 47)."""
    for d_phi, d_h in [(128, 128), (64, 64), (48, 128), (256, 64)]:
        r = phi_once_token_equiv(d_phi, d_h)
        assert r == Fraction(phi_once_bytes(d_phi, d_h, 2), token_bytes(d_h, 2))
        assert r == Fraction(d_phi, 2) + Fraction(d_phi, d_h)
    assert phi_once_token_equiv(128, 128, elem_ratio=2) == 130  # fp32 cache next to bf16 KV


def test_amortization_over_generation_length() -> None:
    """Eq. 18: k_hyb grows with L_gen and reaches k_topk as the one-time cost vanishes."""
    n = n_budget(0.01, 16384)
    r = phi_once_token_equiv(128, 128)
    ks = [k_hyb(n, 4, 16, r, gen) for gen in (1, 2, 10, 65, 10_000)]
    assert ks == [79, 144 - 33, 144 - 7, 143, 143]
    assert all(a <= b for a, b in zip(ks, ks[1:]))
    assert ks[-1] <= k_topk(n, 4, 16) == 144
    assert n_off(r, 1) == 65 and n_off(r, 10_000) == 1
    assert reads_per_step(20 + 79, r, 1) == 164.0  # eq. 17 at L_gen = 1 fills the budget exactly


def test_infeasible_and_exact_ceilings() -> None:
    p = plan_budget(prefill_len=4096, fraction=0.01, head_dim=128, phi_dim=128)
    assert p.n_budget == 41 and p.k_topk == 21 and p.k_hyb == 0 and not p.hybrid_feasible
    assert n_budget(0.07, 100) == 7  # not 8 (0.07 * 100 == 7.000000000000001 in binary)
    assert n_budget(0.03, 16384) == 492 and n_budget(1.0, 5) == 5
    with pytest.raises(ValueError):
        n_budget(0.0, 10)
    with pytest.raises(ValueError):
        n_off(3, 0)


def _run_cli(argv: list[str]) -> dict:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true")
    parser = argparse.ArgumentParser(prog="kvstash")
    add_budget_command(parser.add_subparsers(dest="command", required=True), common)
    args = parser.parse_args(argv)
    return args.func(args)


def test_budget_command_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_cli(["budget", "--prefill-len", "16384", "--fraction", "0.01", "--head-dim", "128", "--phi-dim",
                    "128", "--sink", "4", "--tail", "16", "--gen-len", "1", "--phi-bytes", "2", "--kv-bytes", "2",
                    "--json"])  # the paper's setting: cache and KV both bf16
    assert {k: out[k] for k in ("n_budget", "k_topk", "n_off", "k_hyb")} == {
        "n_budget": 164, "k_topk": 144, "n_off": 65, "k_hyb": 79}
    assert capsys.readouterr().out == ""  # with --json, main() prints the returned dict
    json.dumps(out)
    text = _run_cli(["budget", "--prefill-len", "16384", "--fraction", "0.03", "--head-dim", "64", "--phi-dim", "64",
                     "--phi-bytes", "2"])
    assert text["k_hyb"] == 439 and json.loads(capsys.readouterr().out)["k_hyb"] == 439
    # Defaults: d_phi of the shipped model's distilled map (16), its float32 cache next to a bf16 KV cache:
    # R_once = (16/2 + 16/64) * 2 = 16.5, n_off = 17, n(0.03) = 492, k_hyb = 492 - 20 - 17.
    shipped = _run_cli(["budget", "--prefill-len", "16384", "--fraction", "0.03", "--head-dim", "64", "--json"])
    assert (shipped["phi_dim"], shipped["r_phi_once"], shipped["n_off"], shipped["k_hyb"]) == (16, 16.5, 17, 455)
