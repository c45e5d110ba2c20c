"""Mutual TLS for the gRPC services and their clients: one typed config, from flags and the environment."""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from store.errors import InvalidInput

TLS_CERT_ENV = "KVSTASH_TLS_CERT"
"""PEM certificate this process presents (a server's to its clients, a client's to the server)."""
TLS_KEY_ENV = "KVSTASH_TLS_KEY"
"""PEM private key of ``KVSTASH_TLS_CERT``."""
TLS_CA_ENV = "KVSTASH_TLS_CA"
"""PEM CA bundle the peer's certificate must chain to (servers require a client certificate from it)."""
FIELDS = {"cert": ("--tls-cert", TLS_CERT_ENV), "key": ("--tls-key", TLS_KEY_ENV), "ca": ("--tls-ca", TLS_CA_ENV)}
"""Each field of ``TlsConfig``: its flag and its environment variable (a flag wins over the variable)."""
HELP = {"cert": "PEM certificate this process presents", "key": "PEM private key of --tls-cert",
        "ca": "PEM CA the peer's certificate must chain to"}


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    """Mutual TLS material: this side's certificate and key, and the CA the other side's certificate chains to."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def resolve(cls, values: Mapping[str, str | Path | None]) -> TlsConfig | None:
        """A config from ``cert``/``key``/``ca`` values: None when none is set, InvalidInput when only some are."""
        given = {name: Path(v) for name, v in values.items() if v}
        if not given:
            return None
        missing = [f"{FIELDS[name][0]} / {FIELDS[name][1]}" for name in FIELDS if name not in given]
        if missing:
            raise InvalidInput(f"mutual TLS needs a certificate, its key and a CA; missing {', '.join(missing)} "
                               "(set all three, or none for plaintext)")
        return cls(cert=given["cert"], key=given["key"], ca=given["ca"])

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, flags: argparse.Namespace | None = None
                 ) -> TlsConfig | None:
        """The config from ``$KVSTASH_TLS_CERT``, ``$KVSTASH_TLS_KEY`` and ``$KVSTASH_TLS_CA``, each overridden by its
        ``add_tls_args`` flag in ``flags`` when that is given."""
        env = os.environ if env is None else env
        return cls.resolve({name: (getattr(flags, f"tls_{name}") if flags is not None else None)
                            or env.get(var, "").strip() for name, (_, var) in FIELDS.items()})

    def validate(self) -> TlsConfig:
        """This config, once every file reads as PEM and the key matches the certificate (InvalidInput if not)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            raise InvalidInput(f"TLS certificate {self.cert} / key {self.key}: {_reason(e)}") from None
        try:
            ctx.load_verify_locations(cafile=self.ca)
        except (OSError, ssl.SSLError) as e:
            raise InvalidInput(f"TLS CA {self.ca}: {_reason(e)}") from None
        return self

    def _read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()
        except OSError as e:
            raise InvalidInput(f"TLS file unreadable: {_reason(e)}") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials that refuse any client without a certificate from the CA."""
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials presenting this certificate and trusting only the CA."""
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _reason(e: OSError | ssl.SSLError) -> str:
    if isinstance(e, ssl.SSLError):
        return f"not valid PEM, or the key does not match ({e.reason or e})"
    return f"{e.strerror or e}: {e.filename}" if e.filename else str(e)


def add_tls_args(p: argparse.ArgumentParser) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca`` (each defaults to its ``KVSTASH_TLS_*`` variable)."""
    for name, (flag, var) in FIELDS.items():
        p.add_argument(flag, type=Path, default=None,
                       help=f"gRPC mutual TLS: {HELP[name]} (default: ${var}); all three TLS files or none (plaintext)")


def tls_or_exit(args: argparse.Namespace | None, process: str) -> TlsConfig | None:
    """The validated config of ``add_tls_args`` flags (when ``args`` is given) over the environment; exits with
    the reason when it is partial or its files are unusable (never a silent fallback to plaintext)."""
    try:
        tls = TlsConfig.from_env(flags=args)
        return tls.validate() if tls else None
    except InvalidInput as e:
        raise SystemExit(f"{process}: {e}") from None
