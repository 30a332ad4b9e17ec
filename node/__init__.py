"""A node of the network: the processes a user runs, built on protocol/, merge/ and skills/. Its packages, in
the order data flows through a network:

- rl/           the RL engine: asynchronous multi-turn GRPO on one skill shard, from a model to its delta
- endpoint/     the recording OpenAI-compatible endpoint: harnesses play, every call recorded for training
- roles/        the two roles: worker (train a round, publish its delta) and coordinator (screen a round's
                deltas through its steps in rounds/, merge, publish, verify)
- checkpoints/  the local checkpoint store, pulls of signed checkpoints (every hash verified), hub models
- network/      a node's session on the network (key, DHT peer, stores, stop on signals), what it sees
                of the network, and the live dashboard
- demo/         a whole swarm on this machine: its settings, supervisor, run, comparison and report
- cli/          the `skillswarm` command line, one module per command group
"""
