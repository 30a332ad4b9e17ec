"""One exception per boundary; each message tells the user what is wrong and what to do."""


class SkillswarmError(Exception):
    """Base of every error the CLI reports as a clean one-line message."""


class RecordError(SkillswarmError):
    """A record failed to decode or validate (bad bytes, type, range, size or protocol version)."""


class SignatureError(RecordError):
    """A record's signature, author or network does not check out."""


class IdentityError(SkillswarmError):
    """A key file is missing, unreadable, has unsafe permissions or holds no Ed25519 key."""


class SpecError(SkillswarmError):
    """A network file (TOML) is missing, malformed or inconsistent."""


class HashMismatchError(SkillswarmError):
    """Bytes on disk or from a peer do not match the sha256 they were announced with."""
