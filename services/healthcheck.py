"""``python -m services.healthcheck ADDR``: exit 0 when the gRPC server at ADDR is SERVING."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def check(address: str, service: str = "") -> bool:
    """Whether ``service`` at ``address`` reports SERVING."""
    with grpc.insecure_channel(address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=TIMEOUT_S)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


if __name__ == "__main__":
    sys.exit(0 if check(sys.argv[1]) else 1)
