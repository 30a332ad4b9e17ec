"""Versions: the package release and the wire protocol that records carry."""

from importlib.metadata import PackageNotFoundError, version

# Bumped whenever a record's schema or a DHT key layout changes incompatibly. 2: a checkpoint manifest's delta entry
# says the decoder layers it was merged in as its own field, `layers` (protocol 1 carried it as a figure). 3: a delta
# manifest names its blob's tree hash (`tree`), so whoever holds the delta serves it piece by piece.
PROTOCOL_VERSION = 3

try:
    __version__ = version("skillswarm")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
