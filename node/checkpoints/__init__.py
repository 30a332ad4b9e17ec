"""Checkpoints on this machine. In data-flow order:

- hub.py    where a model reference lives: a local directory, or a Hugging Face hub id fetched into the hub cache
- store.py  the local checkpoint store of one network: whole checkpoint directories by version, each with its signed
            manifest; round directories of a worker's training
- pull.py   find a checkpoint signed by a trusted coordinator, make it complete in the store (every hash verified,
            only the merged delta when the parent is held), and export it (`pull --out`, `--adapter`)
"""
