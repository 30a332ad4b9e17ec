"""Versions: the package release and the wire protocol that records carry."""

from importlib.metadata import PackageNotFoundError, version

# Bumped whenever a record's schema or a DHT key layout changes incompatibly.
PROTOCOL_VERSION = 1

try:
    __version__ = version("skillswarm")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
