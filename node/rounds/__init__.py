"""A coordinator's round as swappable steps (Flower's strategies are the model). In data-flow order:

- context.py     Candidate (one delta manifest moving through the round), RoundContext, the Step protocol
- admission.py   Admission (manifest-only checks) and Caps (per key, per round) before any download
- fetching.py    Fetch: the round's blobs, concurrently, within its budget
- inspection.py  Inspect (file structure, finiteness, norm claim and bounds) and Consensus (direction)
- paired.py      paired comparisons of two models on the same tasks: sign test, Pocock's level for two looks
- usefulness.py  Usefulness: each candidate against the parent, paired, on tasks seeded after publication
- reputation.py  keys' records across rounds: gate, order, Weigh (a delta's weight), say in the consensus
- guard.py       MergeGuard: the merged model against the parent; a worse skill's reserve first, else takes out
                 the delta that cost it most
- strategy.py    the default steps, RoundStrategy (screen -> groups -> merge, guarded -> evaluate)

`coordinator.py` collects the round's manifests, runs a RoundStrategy, and commits and publishes.
"""

from skillswarm.node.rounds.context import Candidate, RoundContext, Step
from skillswarm.node.rounds.strategy import RoundStrategy, default_steps, evaluate_all

__all__ = ["Candidate", "RoundContext", "RoundStrategy", "Step", "default_steps", "evaluate_all"]
