"""Build the shipped text corpus (lab/synth/data) from Debian packages.

Run once, on a machine with apt (the result is committed, so training never needs it):

    mkdir -p /tmp/debs && cd /tmp/debs && apt-get download r-cran-janeaustenr jargon-text dict-devil wamerican
    for f in *.deb; do mkdir -p x/${f%%_*}; dpkg -x $f x/${f%%_*}; done
    python -m lab.synth.corpus_build --debs /tmp/debs/x

Needs the `rdata` package (reads the R lazy-load database that holds Austen's novels).
Sources and licences are recorded in lab/synth/data/SOURCES.md.
"""

from __future__ import annotations

import argparse
import gzip
import lzma
import re
import unicodedata
import warnings
import zlib
from pathlib import Path

from lab.synth.corpus import DATA_DIR, HELDOUT_FILE, TRAIN_FILE, WORDS_FILE

AUSTEN_DB = "r-cran-janeaustenr/usr/lib/R/site-library/janeaustenr/data/Rdata"
JARGON = "jargon-text/usr/share/doc/jargon-text/jargon.txt.gz"
DEVIL = "dict-devil/usr/share/dictd/devil.dict.dz"
WORDS = "wamerican/usr/share/dict/american-english"
HELDOUT_NOVELS = ("persuasion",)
MIN_PARAGRAPH_CHARS = 40
QUOTES = {"\u201c": '"', "\u201d": '"', "\u2018": "'", "\u2019": "'", "\u2014": "--", "\u2013": "-"}


def ascii_text(text: str) -> str:
    """Map typographic punctuation to ASCII and drop other non-ASCII characters."""
    for src, dst in QUOTES.items():
        text = text.replace(src, dst)
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()


def paragraphs(text: str) -> list[str]:
    """Reflow hard-wrapped text into one line per paragraph, dropping short lines (headings)."""
    out = []
    for block in re.split(r"\n\s*\n", ascii_text(text)):
        para = " ".join(block.split()).replace("_", "")
        if len(para) >= MIN_PARAGRAPH_CHARS:
            out.append(para)
    return out


def austen_novels(debs: Path) -> dict[str, str]:
    """Read the six novels from janeaustenr's R lazy-load database."""
    import rdata  # only needed here

    base = debs / AUSTEN_DB
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        index = rdata.conversion.convert(
            rdata.parser.parse_data(gzip.decompress(base.with_suffix(".rdx").read_bytes()))
        )
        blob = base.with_suffix(".rdb").read_bytes()
        novels = {}
        for name, (offset, length) in index["variables"].items():
            chunk = blob[int(offset) : int(offset) + int(length)]
            lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(chunk[4:])))
            novels[str(name)] = "\n".join(str(line) for line in lines)
    return novels


def write_xz(path: Path, text: str) -> None:
    """Write text as xz-compressed UTF-8."""
    path.write_bytes(lzma.compress(text.encode(), preset=9 | lzma.PRESET_EXTREME))


def build(debs: Path) -> None:
    """Write train.txt.xz, heldout.txt.xz and words.txt.xz."""
    novels = austen_novels(debs)
    train = [p for name in sorted(novels) if name not in HELDOUT_NOVELS for p in paragraphs(novels[name])]
    train += paragraphs(gzip.decompress((debs / JARGON).read_bytes()).decode())
    heldout = [p for name in HELDOUT_NOVELS for p in paragraphs(novels[name])]
    heldout += paragraphs(gzip.decompress((debs / DEVIL).read_bytes()).decode())
    words = sorted({w for w in (debs / WORDS).read_text().split() if re.fullmatch(r"[a-z]{3,10}", w)})
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    write_xz(TRAIN_FILE, "\n".join(train))
    write_xz(HELDOUT_FILE, "\n".join(heldout))
    write_xz(WORDS_FILE, "\n".join(words))


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--debs", type=Path, required=True, help="folder with the unpacked packages")
    build(parser.parse_args().debs)


if __name__ == "__main__":
    main()
