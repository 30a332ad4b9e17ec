"""Node identities: an Ed25519 key per node, kept in a 0600 file, a libp2p-style peer id derived from
the public key, and signatures over records' canonical encoding."""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Iterable, TypeVar

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from skillswarm.protocol.codec import canonical_bytes, decode_record, encode_record
from skillswarm.protocol.errors import IdentityError, SignatureError
from skillswarm.protocol.paths import default_key_path
from skillswarm.protocol.records import Record, kind_of

R = TypeVar("R", bound=Record)

# Domain separation: a skillswarm signature can never be replayed as a signature on anything else.
_SIGNING_PREFIX = b"skillswarm/record/v1\x00"
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, r = divmod(n, 58)
        out = _B58[r] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id of an Ed25519 public key (identity multihash of its protobuf, base58btc),
    so the same key can name a node in skillswarm records and on the libp2p network."""
    if len(public_key) != 32:
        raise IdentityError(f"an Ed25519 public key is 32 bytes, got {len(public_key)}")
    proto = b"\x08\x01\x12\x20" + public_key  # PublicKey{Type: Ed25519, Data: key}
    return _b58encode(b"\x00" + bytes([len(proto)]) + proto)


def fingerprint(public_key_hex: str) -> str:
    """A short, human-comparable fingerprint of a public key (first 16 hex chars of its sha256)."""
    return hashlib.sha256(bytes.fromhex(public_key_hex)).hexdigest()[:16]


class Identity:
    """A node's signing key. Create with `load_or_create` (persistent) or `generate` (ephemeral)."""

    def __init__(self, private_key: Ed25519PrivateKey, path: Path | None = None) -> None:
        self._key = private_key
        self.path = path
        raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public_key: bytes = raw
        self.public_key_hex: str = raw.hex()
        self.peer_id: str = peer_id_from_public_key(raw)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh key that lives only in memory."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: Path | str) -> Identity:
        """Read a PEM (PKCS#8) Ed25519 key file; refuse a file others can read."""
        path = Path(path).expanduser()
        try:
            mode = path.stat().st_mode
            data = path.read_bytes()
        except FileNotFoundError:
            raise IdentityError(f"key file {path} does not exist; run `skillswarm id --key {path}` to create it") from None
        except OSError as e:
            raise IdentityError(f"cannot read key file {path}: {e.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise IdentityError(f"key file {path} is readable by other users; run `chmod 600 {path}`")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise IdentityError(f"key file {path} holds no readable private key ({e}); move it away to make a new one") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"key file {path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key, path)

    @classmethod
    def load_or_create(cls, path: Path | str | None = None) -> Identity:
        """The node's persistent identity: load the key file, creating it (mode 0600) on first use."""
        path = Path(path).expanduser() if path else default_key_path()
        if not path.exists():
            try:
                cls._create(path)
            except OSError as e:
                raise IdentityError(f"cannot create the key file {path} ({e.strerror or e}); pass --key with a path in a "
                                    "directory you can write (or set SKILLSWARM_KEY)") from None
        return cls.load(path)

    @classmethod
    def claim(cls, path: Path | str | None = None) -> "Identity":
        """`load_or_create`, and hold the key for the life of this process: one key is one peer id, and two
        nodes sharing it look like one peer that keeps changing address (IdentityError names the holder)."""
        identity = cls.load_or_create(path)
        _hold(Path(path).expanduser() if path else default_key_path())
        return identity

    @staticmethod
    def _create(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".key-")  # mkstemp creates it 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic and exclusive: a concurrent creator's key wins, never a mix
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)

    def private_bytes(self) -> bytes:
        """The raw 32-byte Ed25519 seed (for deriving the libp2p identity of this node's DHT peer)."""
        return self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())

    def sign(self, message: bytes) -> bytes:
        """Sign raw bytes (domain-separated from record signatures)."""
        return self._key.sign(b"skillswarm/raw/v1\x00" + message)

    def sign_record(self, record: R, *, created: float | None = None, validate: bool = True) -> R:
        """Return the record with this identity as author, a creation time, and a signature. The record is
        validated and normalised first (an int in a float field becomes a float; an invalid record raises
        RecordError), so what is signed is exactly what every reader decodes, from msgpack or TOML alike.
        `validate=False` signs the record as given (tests forging bad records)."""
        unsigned = msgspec.structs.replace(
            record,
            author=self.public_key_hex,
            created=time.time() if created is None else created,
            signature=b"",
        )
        if validate:
            unsigned = decode_record(encode_record(unsigned), type(record))
        signature = self._key.sign(_SIGNING_PREFIX + canonical_bytes(unsigned))
        return msgspec.structs.replace(unsigned, signature=signature)


_held: dict[Path, int] = {}  # key file -> the descriptor whose lock this process holds


def _hold(path: Path) -> None:
    """Take an exclusive lock on KEY.lock (released by the kernel when this process ends, however it ends)."""
    import fcntl
    import sys

    lock = path.with_name(path.name + ".lock").resolve()
    if lock in _held:
        return
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise IdentityError(f"the key {path} is in use by {holder} on this machine; two nodes with one key are one "
                            "peer id to the network, which cannot tell them apart: give this node its own key with "
                            "--key FILE (created on first use)") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"process {os.getpid()} ({' '.join(['skillswarm', *sys.argv[1:3]])})".encode())
    _held[lock] = fd


def verify_record(record: Record, *, network: str, trusted: Iterable[str] | None = None) -> None:
    """Check a record is signed by its author, belongs to `network`, and (if given) comes from a
    trusted key. Raises `SignatureError` saying which check failed."""
    kind = kind_of(type(record))
    if record.network != network:
        raise SignatureError(f"{kind} record belongs to network `{record.network}`, not `{network}`")
    if not record.signature or not record.author:
        raise SignatureError(f"{kind} record is not signed")
    if trusted is not None and record.author not in set(trusted):
        raise SignatureError(f"{kind} record is signed by {fingerprint(record.author)}, which this network does not trust")
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(record.author)).verify(
            record.signature, _SIGNING_PREFIX + canonical_bytes(record)
        )
    except (InvalidSignature, ValueError):
        raise SignatureError(f"{kind} record from {fingerprint(record.author)} has a bad signature (altered or forged)") from None


def verify_raw(public_key_hex: str, signature: bytes, message: bytes) -> bool:
    """Check a signature made by `Identity.sign`."""
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key_hex)).verify(signature, b"skillswarm/raw/v1\x00" + message)
        return True
    except (InvalidSignature, ValueError):
        return False
