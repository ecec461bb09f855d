"""Generated protobuf and gRPC stubs (do not edit; see scripts/generate_stubs.py)."""
