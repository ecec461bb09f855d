"""Regenerate the checked-in Python stubs from proto/ (one command: `python scripts/generate_stubs.py`).

Writes `_pb2.py`, `_pb2.pyi` and `_pb2_grpc.py` (+ `_pb2_grpc.pyi` from mypy-protobuf) under the package
path that matches each proto package, so `shardrouter.v1` lives in `shardrouter/v1/`. With `--out DIR`
it writes elsewhere, which the freshness test uses to compare against the checked-in files.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIRS = ("shardrouter/v1", "shardrouter/internal/v1")


# Vendored for protoc and buf only: their Python modules come from googleapis-common-protos.
VENDORED = PROTO_ROOT / "google"


def proto_files() -> list[Path]:
    """Every .proto of ours under proto/ (not the vendored google/ ones), in a stable order."""
    return sorted(p for p in PROTO_ROOT.rglob("*.proto") if not p.is_relative_to(VENDORED))


def generate(out: Path) -> None:
    """Run protoc with the Python, .pyi, gRPC and mypy-gRPC plugins into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    # protoc finds its plugins (protoc-gen-mypy_grpc) on PATH; the venv's bin may not be on it.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_grpc_out={out}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    for package_dir in PACKAGE_DIRS:
        init = out / package_dir / "__init__.py"
        init.parent.mkdir(parents=True, exist_ok=True)
        if not init.exists():
            init.write_text(
                '"""Generated protobuf and gRPC stubs (do not edit; see scripts/generate_stubs.py)."""\n'
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="where to write (default: the repo root)")
    args = parser.parse_args(argv)
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
