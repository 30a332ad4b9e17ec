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


class NetworkError(SkillswarmError):
    """The DHT peer could not start, join the network, or stopped answering."""


class BlobError(SkillswarmError):
    """A blob is unknown, too large, or no provider could deliver bytes that match its sha256."""


class MergeError(SkillswarmError):
    """A delta, checkpoint or recipe given to the merge engine is unreadable, malformed or inconsistent."""


class SkillError(SkillswarmError):
    """A skill is unknown, fails to load, or is misconfigured (task bank, environment, rubric)."""


class ModelError(SkillswarmError):
    """A model directory is missing, incomplete or fails to load, or a base-model recipe is invalid."""


class TrainError(SkillswarmError):
    """A training run is misconfigured, or its run directory cannot be resumed as asked."""
