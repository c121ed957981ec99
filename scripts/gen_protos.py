"""Generate the Python stubs for proto/kvferry/v1/*.proto into kvferry/v1/.

One script, run by `make proto` and by `make check` (which then fails if the
committed stubs differ from what it produced). Writes `_pb2.py`, `_pb2_grpc.py`
and their `.pyi` (mypy-protobuf) next to each other.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_PACKAGE = ROOT / "kvferry" / "v1"


def main() -> int:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "kvferry" / "v1").glob("*.proto"))
    if not protos:
        print("no .proto files under proto/kvferry/v1", file=sys.stderr)
        return 1
    for old in OUT_PACKAGE.glob("*_pb2*.py*"):
        old.unlink()
    OUT_PACKAGE.mkdir(parents=True, exist_ok=True)
    scripts = Path(sysconfig.get_path("scripts"))
    plugins = []
    for name in ("protoc-gen-mypy", "protoc-gen-mypy_grpc"):
        path = scripts / name if (scripts / name).exists() else shutil.which(name)
        if path is None:
            print(f"{name} not found: install mypy-protobuf", file=sys.stderr)
            return 1
        plugins.append(f"--plugin={name}={path}")
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        *plugins,
        f"--python_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        f"--mypy_out=quiet:{ROOT}",
        f"--mypy_grpc_out=quiet:{ROOT}",
        *protos,
    ]
    subprocess.run(cmd, check=True)
    init = OUT_PACKAGE / "__init__.py"
    init.write_text('"""Generated gRPC stubs for kvferry.v1 (do not edit; see scripts/gen_protos.py)."""\n')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
