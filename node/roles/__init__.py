"""The roles a node runs on a network. In data-flow order:

- worker.py       join, pull the latest trusted checkpoint, train a round of GRPO on one shard, publish the delta
- rounds/         the coordinator's round as steps that take values and return verdicts (its own table of contents)
- coordinator.py  each round: collect the deltas, run the round's steps, merge, evaluate, commit and publish the
                  next checkpoint; `verify_checkpoint` recomputes a published merge bit for bit
- failpoints.py   crash points for the recovery tests (`SKILLSWARM_FAILPOINT`)
"""
