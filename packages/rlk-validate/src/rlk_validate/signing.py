"""Signed seals: an Ed25519 signature over ``COMPLETE`` (``rlk-validate --seal --sign-key KEY``), checked
against a trusted public key (``--verify-key PUB``).

A checksum seal proves that nothing under the run changed since *somebody* ran ``rlk-validate --seal``; anyone
who can write the directory can edit it and seal it again. A signature names who sealed it: the holder of the
private key. The signed message is the canonical JSON (sorted keys, no spaces) of ``COMPLETE`` without its
``signature`` — its schema, the sha256 of ``run-validation.json`` (which holds the digest of every file under
the run), the seal time and the validator. ``docs/evidence.md`` ("Guarantees and threat model") says what this
does and does not prove.

Keys are PEM files (PKCS#8 private key, SubjectPublicKeyInfo public key): ``rlk-validate keygen DIR`` writes a
pair. The cryptography comes from the ``cryptography`` package (``pip install 'rlk-validate[sign]'``), imported
only when a key is used or a signature checked; everything else of rlk-validate works without it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from typing import Any

from .findings import Finding, finding

SCHEME = "ed25519"
INSTALL = "pip install 'rlk-validate[sign]'"
PRIVATE_NAME, PUBLIC_NAME = "rlk-seal.key", "rlk-seal.pub"


class KeyProblem(ValueError):
    """A key file that cannot be used (one line: what and why)."""


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise KeyProblem(f"signed seals need the cryptography package ({INSTALL})") from None
    return serialization, ed25519


def _raw_public(key: Any) -> bytes:
    serialization, _ = _crypto()
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_key: Any) -> str:
    """``sha256:<hex>`` of the raw 32-byte public key: what a report names a key by."""
    return "sha256:" + hashlib.sha256(_raw_public(public_key)).hexdigest()


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(1 << 16)
    except OSError as e:
        raise KeyProblem(f"cannot read the {what} {path}: {e.strerror or e}") from None


def load_private_key(path: str) -> Any:
    serialization, ed25519 = _crypto()
    try:
        key = serialization.load_pem_private_key(_read(path, "signing key"), password=None)
    except (ValueError, TypeError) as e:
        raise KeyProblem(f"{path} is not an unencrypted PEM private key ({e})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise KeyProblem(f"{path} is a {type(key).__name__}, not an Ed25519 private key")
    return key


def load_public_key(path: str) -> Any:
    serialization, ed25519 = _crypto()
    try:
        key = serialization.load_pem_public_key(_read(path, "public key"))
    except (ValueError, TypeError) as e:
        raise KeyProblem(f"{path} is not a PEM public key ({e})") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise KeyProblem(f"{path} is a {type(key).__name__}, not an Ed25519 public key")
    return key


def message(complete: dict[str, Any]) -> bytes:
    """What is signed: ``COMPLETE`` without its signature, as canonical JSON."""
    body = {k: v for k, v in complete.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def sign(private_key: Any, complete: dict[str, Any]) -> dict[str, str]:
    """The ``signature`` member of ``COMPLETE`` for the body ``complete``."""
    public = private_key.public_key()
    return {"scheme": SCHEME, "key_id": key_id(public),
            "public_key": base64.b64encode(_raw_public(public)).decode(),
            "value": base64.b64encode(private_key.sign(message(complete))).decode()}


def generate(directory: str) -> tuple[str, str]:
    """Write a new key pair into ``directory`` (``rlk-seal.key`` mode 0600, ``rlk-seal.pub``); never overwrites."""
    serialization, ed25519 = _crypto()
    key = ed25519.Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    os.makedirs(directory, exist_ok=True)
    out = []
    for name, data, mode in ((PRIVATE_NAME, priv, 0o600), (PUBLIC_NAME, pub, 0o644)):
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
        except FileExistsError:
            raise KeyProblem(f"{path} exists; keygen never overwrites a key") from None
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        out.append(path)
    return out[0], out[1]


def _f(code: str, msg: str, **kw: Any) -> Finding:
    return finding(code, msg, check="seal", path="COMPLETE", **kw)


def check(complete: dict[str, Any], verify_key: str | None) -> list[Finding]:
    """Findings about the signature of a well-formed ``COMPLETE``: none / self-consistent / by the trusted key."""
    sig = complete.get("signature")
    if sig is None:
        if verify_key is None:
            return []
        return [_f("SIGNATURE_MISSING", f"--verify-key {verify_key}: COMPLETE carries no signature; a checksum seal "
                   "can be remade by anyone who can write the directory")]
    if not (isinstance(sig, dict) and sig.get("scheme") == SCHEME
            and all(isinstance(sig.get(k), str) for k in ("key_id", "public_key", "value"))):
        return [_f("SIGNATURE_INVALID", f"COMPLETE's signature is not an {SCHEME} signature rlk-validate writes")]
    try:
        _, ed25519 = _crypto()
    except KeyProblem as e:
        if verify_key is not None:
            raise
        return [_f("SIGNATURE_UNCHECKED", f"COMPLETE is signed by {sig['key_id'][:80]}; {e}", severity="warning")]
    try:
        raw = base64.b64decode(sig["public_key"], validate=True)
        value = base64.b64decode(sig["value"], validate=True)
        embedded = ed25519.Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, TypeError):
        return [_f("SIGNATURE_INVALID", "COMPLETE's signature or public key is not valid base64 Ed25519 data")]
    from cryptography.exceptions import InvalidSignature

    try:
        embedded.verify(value, message(complete))
    except InvalidSignature:
        return [_f("SIGNATURE_INVALID", "COMPLETE's signature does not verify: COMPLETE was changed after signing")]
    if key_id(embedded) != sig["key_id"]:
        return [_f("SIGNATURE_INVALID", "COMPLETE's key_id is not the id of the public key it carries")]
    if verify_key is None:
        return [_f("SEAL_SIGNED", f"COMPLETE is signed by key {sig['key_id']} (self-consistent; pass --verify-key "
                   "PUB to check it is a key you trust)")]
    trusted = load_public_key(verify_key)
    if key_id(trusted) != sig["key_id"]:
        return [_f("SIGNATURE_INVALID", f"COMPLETE is signed by key {sig['key_id']}, not by the trusted key "
                   f"{key_id(trusted)} ({verify_key}): the run was sealed again by someone else")]
    return [_f("SEAL_SIGNED", f"COMPLETE is signed by the trusted key {sig['key_id']} ({verify_key})")]
