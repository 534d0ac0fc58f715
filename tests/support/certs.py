"""Test certificates, made fresh by the tests with the ``cryptography`` package.

One CA signs the server certificate (CN localhost, SANs localhost/127.0.0.1/::1) and a
client certificate (CN ``client-1``); a second, untrusted CA signs ``stranger``. Files
are PEM under a temporary directory; the same files are given to pybroker and nsqd.
"""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class CertSet:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    stranger_cert: str
    stranger_key: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return str(path)


def _write_cert(cert: x509.Certificate, path: Path) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _issue(cn: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
           issuer_key: ec.EllipticCurvePrivateKey, ca: bool = False,
           server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(issuer)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(hours=1))
         .not_valid_after(now + datetime.timedelta(days=2))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                          crl_sign=True, content_commitment=False,
                                          key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False,
                                          decipher_only=False), critical=True)
        b = b.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                            critical=False)
    else:
        b = b.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
            issuer_key.public_key()), critical=False)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1"))]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_certs(directory: Path) -> CertSet:
    """Write a CA, a server and two client certificates into directory."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("pybroker test CA", ca_key, _name("pybroker test CA"), ca_key, ca=True)
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = _name("untrusted CA")
    out = {"ca": _write_cert(ca, directory / "ca.pem")}
    for label, cn, issuer, issuer_key, server in (
            ("server", "localhost", ca.subject, ca_key, True),
            ("client", "client-1", ca.subject, ca_key, False),
            ("stranger", "stranger", other, other_key, False)):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(cn, key, issuer, issuer_key, server=server)
        out[f"{label}_cert"] = _write_cert(cert, directory / f"{label}.pem")
        out[f"{label}_key"] = _write_key(key, directory / f"{label}-key.pem")
    return CertSet(**out)
