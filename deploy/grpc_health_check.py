#!/usr/bin/env python3
"""grpc-health-check: ask a gRPC server's grpc.health.v1 Health service, over TLS or mTLS if told.

Kubelet's native gRPC probes speak plaintext only, so a shardd (which requires client certificates)
or a router serving mTLS cannot be probed by them; their pods run this instead, as an exec probe,
with the pod's own certificate (the image installs it as /usr/local/bin/grpc-health-check).

    grpc-health-check --address 127.0.0.1:50061 --server-name shardd \\
        --cert /etc/shardd/tls/tls.crt --key /etc/shardd/tls/tls.key --ca /etc/shardd/tls/ca.crt

Without --ca/--cert it connects in plaintext. --server-name is the name checked against the
server's certificate (it must be one of its DNS names), whatever address is dialled.
Exit status: 0 SERVING, 1 any other health status, 2 no answer (connection, TLS, deadline) or a
usage error. One line on standard output or standard error says which.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = 0
NOT_SERVING = 1
NO_ANSWER = 2


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="grpc-health-check", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--address", default="127.0.0.1:50051", help="host:port to dial")
    parser.add_argument("--service", default="", help='service name to ask about ("" = the server)')
    parser.add_argument("--server-name", default="", help="name expected in the server certificate")
    parser.add_argument("--ca", default="", help="CA certificate file that signed the server's certificate")
    parser.add_argument("--cert", default="", help="client certificate file (mTLS)")
    parser.add_argument("--key", default="", help="client private key file (mTLS)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    if bool(args.cert) != bool(args.key):
        parser.error("--cert and --key go together")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    return args


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """A plaintext channel, or a TLS one (with a client certificate when given)."""
    if not (args.ca or args.cert):
        return grpc.insecure_channel(args.address)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(args.ca).read_bytes() if args.ca else None,
        private_key=Path(args.key).read_bytes() if args.key else None,
        certificate_chain=Path(args.cert).read_bytes() if args.cert else None,
    )
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(args.address, credentials, options=options)


def check(args: argparse.Namespace) -> int:
    """Ask once; the exit status as described in the module docstring."""
    try:
        channel = open_channel(args)
    except OSError as exc:
        print(f"grpc-health-check: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return NO_ANSWER
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            print(f"grpc-health-check: {args.address}: {code}: {details}", file=sys.stderr)
            return NO_ANSWER
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if response.status == health_pb2.HealthCheckResponse.SERVING:
        print(f"{args.address} {args.service or '(server)'}: {status}")
        return SERVING
    print(f"grpc-health-check: {args.address} {args.service or '(server)'}: {status}", file=sys.stderr)
    return NOT_SERVING


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    return check(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
