"""The `skillswarm` command line (typer + rich): one module per command group, named `GROUP_cmd.py`.

- app.py                 the entry point: global options, logging, every group registered
- common.py, options.py  what commands share: console, --json, errors; options read from settings dataclasses
- swarm_opts.py          the options of commands that join a network as a long-running node
- id_cmd, net_cmd (+ net_inspect_cmd: net skills | deltas | checkpoints | dashboard), node_cmd, coordinator_cmd,
  pull_cmd: the network;  train_cmd, eval_cmd, report_cmd, base_cmd, skills_cmd, sandbox_cmd: one machine;
  merge_cmd: merging;  endpoint_cmd: the recording endpoint and ingest;  demo_cmd: the whole swarm here
"""
