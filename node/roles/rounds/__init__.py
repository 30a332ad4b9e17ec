"""A coordinator's round as swappable steps (Flower's strategies are the model: each step takes values and returns
values). In data-flow order:

- state.py       what moves through the round, all values: RoundInputs (what it starts from), Candidate (one delta
                 manifest), each step's Verdict (passed, rejected, evidence), Merged (the merge and its lambda),
                 GuardVerdict, RoundState (what the round decided so far), the Step protocol
- admission.py   Admission (manifest-only checks) and Caps (per key, per round) before any download
- fetching.py    Fetch: the round's blobs, concurrently, within its budget
- inspection.py  Inspect (file structure, finiteness, norm claim and bounds, copies) and Consensus (direction)
- paired.py      paired comparisons of two models on the same tasks: sign test, Pocock's level for two looks
- usefulness.py  Usefulness: each candidate against the parent, paired, on tasks seeded after publication
- reputation.py  keys' records across rounds: gate, order, Weigh (a delta's weight), say in the consensus
- scale_search.py ScaleSearch: the merge at each of the network's lambdas, kept only on significant evidence
- guard.py       MergeGuard: the merged model against the parent; a worse skill's reserve first, else takes out
                 the delta that cost it most
- strategy.py    the default steps, RoundStrategy: the driver (screen -> merge, searched and guarded -> evaluate),
                 which makes each next RoundState from a step's verdict; its merge is `merge.round_merge`

`coordinator.py` collects the round's manifests, runs a RoundStrategy, and commits and publishes.
"""

from skillswarm.node.roles.rounds.state import (Candidate, Evidence, GuardVerdict, Merged, Rejected, RoundInputs, RoundState,
                                          Step, Verdict)
from skillswarm.node.roles.rounds.strategy import RoundStrategy, default_steps, evaluate_all

__all__ = ["Candidate", "Evidence", "GuardVerdict", "Merged", "Rejected", "RoundInputs", "RoundState", "RoundStrategy",
           "Step", "Verdict", "default_steps", "evaluate_all"]
