"""The demo: a whole swarm on this machine (`skillswarm demo`, `make demo`). In data-flow order:

- config.py      DemoConfig (what the demo runs, each value derived from the network's or training's defaults
                 where it is not the demo's own) and the demo network (`make_spec`)
- supervisor.py  Swarm: the bootstrap, coordinator and worker processes, every one stopped on the way out
- run.py         run_demo: start the swarm, wait for the rounds, pull the final checkpoint, re-measure, report
- compare.py     the last round re-merged with other methods (`--compare`), through the coordinator's round_merge
- retention.py   retention, its paired-bootstrap interval, checkpoints against specialists task by task
- rundir.py      a run's directory: where each worker keeps its models; every round against the first specialists
- report.py      report.json (per skill base / specialist / merged, retention, per round) and report.png
"""

from skillswarm.node.demo.config import NETWORK, DemoConfig, make_spec
from skillswarm.node.demo.run import DemoStatus, run_demo
from skillswarm.node.demo.rundir import specialist_dir, versus_first_specialists

__all__ = ["NETWORK", "DemoConfig", "DemoStatus", "make_spec", "run_demo", "specialist_dir", "versus_first_specialists"]
