"""The RL engine: asynchronous multi-turn GRPO on one skill shard, from a model directory to a trained
model and its delta (`run.train`). What each module holds:

    config        every setting of a run (TrainConfig) and the nested configs built from it
    verifiers_check  what `--skill verifiers:ENV_ID` needs, checked without importing verifiers
    engines/      inference engines behind one interface: base (the contract), hf, vllm
    rollout       multi-turn episodes at token level on an engine (ids, loss mask, behaviour logprobs)
    groups        Sample / Group / Batch, group classification, and the Feed's filters (staleness,
                  zero variance, env errors) between the sources and the trainer
    orchestrator  plays generation batches of groups from a skill's tasks
    sources       where a run's batches come from (sync, a thread, a process) and how weights reach them
    records       recorded trajectories (what the recording endpoint writes) and a trajectory store's files
    store_source  a store's scored groups as batches (`--skill external:NAME --store DIR`)
    grpo          the loss math as pure functions
    anchor        anchor episodes: the starting policy's own right answers on the network's other skills (retain)
    trainer       groups in, one optimizer step out (full or LoRA)
    evaluation    held-out evaluation of a model or engine on a skill
    rundir        the run directory: settings, run checkpoints, the metrics log
    tracking      the metrics log also sent to TensorBoard or Weights & Biases (`--report-to`)
    outputs       a run's outputs: the trained model, its delta, a LoRA run's PEFT adapter, stats
    adapter       PEFT adapters out of full weights (rank-r SVD of a checkpoint against its base)
    run           the run loop: train(TrainConfig) -> TrainResult (a run that plays against the recording
                  endpoint is handed its source by the caller: `endpoint_source`)
    report        PNG plots of a finished run from its metrics log (`skillswarm report`)
"""
