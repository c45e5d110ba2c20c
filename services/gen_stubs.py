"""Generate the Python gRPC stubs in services/gen from proto/ (``python -m services.gen_stubs``)."""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "proto"
PROTO_FILE = "kvstash/v1/kvstash.proto"
GEN_DIR = REPO / "services" / "gen"
STUBS = ("kvstash_pb2.py", "kvstash_pb2.pyi", "kvstash_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into ``out_dir`` and make the stubs import each other as a package."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                str(PROTO_ROOT / PROTO_FILE)]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in STUBS:
            text = (Path(tmp) / "kvstash" / "v1" / name).read_text()
            text = re.sub(r"^from kvstash\.v1 import kvstash_pb2", "from services.gen import kvstash_pb2", text,
                          flags=re.M)
            (out_dir / name).write_text(text)
            written.append(out_dir / name)
    return written


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else GEN_DIR):
        print(p)
