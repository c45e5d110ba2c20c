"""``kvstash budget``: the matched-read retrieval budgets of appendix D for one prefix size.
"""

from __future__ import annotations

import argparse
import json
from fractions import Fraction
from pathlib import Path
from typing import Any

from store.errors import InvalidInput
from workers.budget import plan_budget
from workers.model_source import default_model
from workers.requests import LIMITS

PHI_CACHE_BYTES = 4
"""The stable φ cache (m, u, T) is kept in float32 (``workers/methods/phi.py``)."""


def cmd_budget(args: argparse.Namespace) -> dict[str, Any]:
    """Print ``n_budget``, ``k_topk``, ``n_off`` and ``k_hyb`` (and the rest of the plan)."""
    if args.phi_bytes < 1 or args.kv_bytes < 1:
        raise InvalidInput("--phi-bytes and --kv-bytes must be positive")
    phi_dim = args.phi_dim if args.phi_dim is not None else _shipped_phi_dim(args.model) or args.head_dim
    try:
        plan = plan_budget(prefill_len=args.prefill_len, fraction=args.fraction, head_dim=args.head_dim,
                           phi_dim=phi_dim, sink=args.sink, tail=args.tail, gen_len=args.gen_len,
                           elem_ratio=Fraction(args.phi_bytes, args.kv_bytes))
    except ValueError as e:
        raise InvalidInput(str(e)) from None
    d = plan.to_dict()
    if not getattr(args, "json", False):
        print(json.dumps(d, indent=2))
    return d


def _shipped_phi_dim(model: str | None) -> int | None:
    """d_phi of the distilled map beside the model's weights (``phi_map.json``), when it has one."""
    try:
        name = model or default_model()
    except InvalidInput:
        return None
    try:
        value = json.loads((Path(name).expanduser() / "phi_map.json").read_text()).get("phi_dim")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def add_budget_command(subparsers: Any, common_parent: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``budget`` subcommand to ``subparsers`` (``common_parent`` supplies ``--json`` etc.)."""
    s = subparsers.add_parser("budget", parents=[common_parent],
                              help="token-equivalent retrieval budgets (Top-K vs Top-K+phi) for a prefix size")
    s.add_argument("--prefill-len", type=int, required=True, help="prefix length N in tokens")
    s.add_argument("--fraction", type=float, required=True, help="per-step read budget as a fraction f of N")
    s.add_argument("--head-dim", type=int, required=True, help="per-head dimension d_h")
    s.add_argument("--phi-dim", type=int, default=None,
                   help="feature dimension d_phi (default: the distilled map beside --model's weights, else d_h)")
    s.add_argument("--model", default=None, help="model whose phi_map.json gives d_phi (default: the shipped model)")
    s.add_argument("--phi-bytes", type=int, default=PHI_CACHE_BYTES,
                   help=f"bytes per element of the stable phi cache (default {PHI_CACHE_BYTES}: float32)")
    s.add_argument("--kv-bytes", type=int, default=2, help="bytes per element of the KV cache (default 2: bf16)")
    s.add_argument("--sink", type=int, default=LIMITS.sink_default,
                   help=f"sink anchor tokens (default {LIMITS.sink_default})")
    s.add_argument("--tail", type=int, default=LIMITS.tail_default,
                   help=f"tail anchor tokens (default {LIMITS.tail_default})")
    s.add_argument("--gen-len", type=int, default=LIMITS.gen_len_default,
                   help=f"steps the one-time phi fetch is amortized over (default {LIMITS.gen_len_default}: "
                        "worst case)")
    s.set_defaults(func=cmd_budget)
    return s
