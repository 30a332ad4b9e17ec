"""The transport: the DHT (its background process, record validation, storage caps, republishing) and blob
transfer (the store, the wire format, the provider, the fetcher, round downloads, the stream sockets)."""
