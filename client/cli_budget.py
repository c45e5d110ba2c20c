"""``kvstash budget``: the matched-read retrieval budgets of appendix D for one prefix size.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from store.errors import InvalidInput
from workers.budget import plan_budget
from workers.requests import LIMITS


def cmd_budget(args: argparse.Namespace) -> dict[str, Any]:
    """Print ``n_budget``, ``k_topk``, ``n_off`` and ``k_hyb`` (and the rest of the plan)."""
    phi_dim = args.head_dim if args.phi_dim is None else args.phi_dim
    try:
        plan = plan_budget(prefill_len=args.prefill_len, fraction=args.fraction, head_dim=args.head_dim,
                           phi_dim=phi_dim, sink=args.sink, tail=args.tail, gen_len=args.gen_len)
    except ValueError as e:
        raise InvalidInput(str(e)) from None
    d = plan.to_dict()
    if not getattr(args, "json", False):
        print(json.dumps(d, indent=2))
    return d


def add_budget_command(subparsers: Any, common_parent: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``budget`` subcommand to ``subparsers`` (``common_parent`` supplies ``--json`` etc.)."""
    s = subparsers.add_parser("budget", parents=[common_parent],
                              help="token-equivalent retrieval budgets (Top-K vs Top-K+phi) for a prefix size")
    s.add_argument("--prefill-len", type=int, required=True, help="prefix length N in tokens")
    s.add_argument("--fraction", type=float, required=True, help="per-step read budget as a fraction f of N")
    s.add_argument("--head-dim", type=int, required=True, help="per-head dimension d_h")
    s.add_argument("--phi-dim", type=int, default=None, help="feature dimension d_phi (default: d_h)")
    s.add_argument("--sink", type=int, default=LIMITS.sink_default,
                   help=f"sink anchor tokens (default {LIMITS.sink_default})")
    s.add_argument("--tail", type=int, default=LIMITS.tail_default,
                   help=f"tail anchor tokens (default {LIMITS.tail_default})")
    s.add_argument("--gen-len", type=int, default=LIMITS.gen_len_default,
                   help=f"steps the one-time phi fetch is amortized over (default {LIMITS.gen_len_default}: "
                        "worst case)")
    s.set_defaults(func=cmd_budget)
    return s
