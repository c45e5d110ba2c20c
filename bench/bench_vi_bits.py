"""``kvstash eval`` with extra ``topk+vi`` variants whose value index has other bits / blocks, in one process (in
bench/: it drives the CLI, which lab/ may not import).

Each ``--vi BITS[xBLOCK][c]`` registers, for this process only, a method ``topk+vi<BITS>x<BLOCK>[c]``: ``topk+vi``
reading its own value-index artifact (``valueindex<BITS>x<BLOCK>[c]``, the product's quantizer at that config, ``c``:
with ``clip=True``, built and read
like ``valueindex``: late, charged once in the summaries' bytes). Every variant answers over the same stored
prefixes in the same run, so their answers and reads compare sample by sample with ``topk+vi``'s. The rest of the
command line is ``kvstash eval``'s (``--method topk+vi4x64`` etc. to run them).

    OMP_NUM_THREADS=1 python -m bench.bench_vi_bits --vi 4 --vi 3 -- eval --json --task fwe --length 8192 \\
        --samples 8 --method topk+vi --method topk+vi4x64 --method topk+vi3x64 --budget 0.02 --output F
"""

from __future__ import annotations

import sys

from client.cli_model import METHOD_HELP
from workers.methods.key_index import KeyIndexConfig, KeyIndexSummarizer
from workers.methods.registry import METHODS
from workers.methods.topk import TopKIndexRemainder
from workers.methods.value_index import ValueIndexSummarizer


def register(bits: int, block: int, clip: bool) -> str:
    """Register ``topk+vi<bits>x<block>[c]`` and its summarizer; its method name."""
    config = KeyIndexConfig(bits=bits, block=block, clip=clip)
    tag = f"{bits}x{block}{'c' if clip else ''}"

    class Summ(ValueIndexSummarizer):
        name = f"valueindex{tag}"

        def __init__(self, config: KeyIndexConfig = config):
            super().__init__(config)

    class Method(TopKIndexRemainder):  # reads its summarizer's artifact (``TopKPhi.make_completion``)
        name = f"topk+vi{tag}"
        summarizers = (KeyIndexSummarizer, Summ)

    METHODS[Method.name] = Method
    METHOD_HELP[Method.name] = f"topk+vi with a value index of {config} (lab)"
    return Method.name


def main(argv: list[str]) -> int:
    """``--vi SPEC`` ... ``--`` then ``kvstash`` arguments."""
    split = argv.index("--")
    specs, rest = argv[:split], argv[split + 1:]
    for flag, spec in zip(specs[0::2], specs[1::2], strict=True):
        if flag != "--vi":
            raise SystemExit(f"expected --vi BITS[xBLOCK][c], got {flag}")
        clip = spec.endswith("c")
        bits, _, block = spec.removesuffix("c").partition("x")
        register(int(bits), int(block or 64), clip)
    from client.cli import main as cli_main

    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
