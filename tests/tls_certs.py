"""Throwaway PKI for tests, made with the ``openssl`` CLI: a CA, and server and client certificates it signs."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from services.tls import TlsConfig

DAYS = "1"
EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
"""P-256 keys: generated in milliseconds, where RSA-2048 takes a good fraction of a second each."""


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@dataclass(frozen=True)
class TestCA:
    """A CA's certificate and key in ``dir``."""

    __test__ = False  # not a test class, whatever pytest thinks of the name
    dir: Path
    cert: Path
    key: Path

    @classmethod
    def make(cls, dir: Path, name: str = "kvstash-test-ca") -> TestCA:
        """A new self-signed CA named ``name``."""
        dir.mkdir(parents=True, exist_ok=True)
        cert, key = dir / "ca.pem", dir / "ca.key"
        _openssl("req", "-x509", *EC_KEY, "-days", DAYS, "-subj", f"/CN={name}", "-keyout", str(key),
                 "-out", str(cert), "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        return cls(dir, cert, key)

    def issue(self, name: str, usage: str) -> tuple[Path, Path]:
        """(certificate, key) for ``name`` signed by this CA; ``usage``: serverAuth, clientAuth or both,
        comma-separated (a certificate for serverAuth names localhost and 127.0.0.1)."""
        cert, key = self.dir / f"{name}.pem", self.dir / f"{name}.key"
        ext = ["-addext", f"extendedKeyUsage={usage}", "-addext", "basicConstraints=CA:FALSE"]
        if "serverAuth" in usage:
            ext += ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"]
        _openssl("req", "-x509", *EC_KEY, "-days", DAYS, "-subj", f"/CN={name}", "-CA", str(self.cert),
                 "-CAkey", str(self.key), "-keyout", str(key), "-out", str(cert), *ext)
        return cert, key

    def tls(self, name: str, usage: str) -> TlsConfig:
        """A ``TlsConfig`` presenting a new certificate for ``name`` and trusting this CA."""
        cert, key = self.issue(name, usage)
        return TlsConfig(cert=cert, key=key, ca=self.cert)
