"""The contract between nodes: records, identities and signatures, content hashing, DHT layout."""

from skillswarm.protocol.version import PROTOCOL_VERSION, __version__

__all__ = ["PROTOCOL_VERSION", "__version__"]
