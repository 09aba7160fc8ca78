"""The control plane's PKI: a CA, the kube-apiserver serving certificate and the service-account key pair."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path


def write_pki(d: Path) -> dict[str, Path]:
    """CA, kube-apiserver serving cert, service-account RSA key pair."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    later = now + dt.timedelta(days=7)

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "raytpu-test-ca")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(later)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    srv_key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) for n in ("localhost", "kubernetes", "kubernetes.default",
                                      "kubernetes.default.svc", "kubernetes.default.svc.cluster.local")]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "10.96.0.1")]
    srv_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name).public_key(srv_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(later)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    paths = {
        "ca_crt": d / "ca.crt", "ca_key": d / "ca.key",
        "apiserver_crt": d / "apiserver.crt", "apiserver_key": d / "apiserver.key",
        "sa_key": d / "sa.key", "sa_pub": d / "sa.pub",
    }
    paths["ca_crt"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths["ca_key"].write_bytes(pem_key(ca_key))
    paths["apiserver_crt"].write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    paths["apiserver_key"].write_bytes(pem_key(srv_key))
    paths["sa_key"].write_bytes(pem_key(sa_key))
    paths["sa_pub"].write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    for k in ("ca_key", "apiserver_key", "sa_key"):
        paths[k].chmod(0o600)
    return paths
