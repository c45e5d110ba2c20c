"""``python -m services.healthcheck ADDR``: exit 0 when the gRPC server at ADDR is SERVING.

Speaks mutual TLS when ``KVSTASH_TLS_*`` are set (in a container, the same files the server uses)."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.grpc_common import channel
from services.tls import TlsConfig, tls_or_exit

TIMEOUT_S = 3.0


def check(address: str, service: str = "", tls: TlsConfig | None = None) -> bool:
    """Whether ``service`` at ``address`` reports SERVING."""
    with channel(address, tls) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=TIMEOUT_S)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def main(address: str) -> int:
    """0 when ``address`` is SERVING, 1 when not; exits with the reason when the TLS settings are unusable."""
    return 0 if check(address, tls=tls_or_exit(None, "kvstash-healthcheck")) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
