"""A node on its network. In data-flow order:

- session.py    what every long-running command sets up: network file, key, DHT peer, checkpoint and blob stores,
                and a stop event that Ctrl-C and SIGTERM set
- view.py       what a node sees of the network as JSON-able dicts (`net peers | status | skills | deltas |
                checkpoints --json`)
- dashboard.py  `net dashboard`: a live local web page of the same view (its page in static/)
"""
