"""Processes: the RL engine, the worker and coordinator roles, the checkpoint store and the CLI."""
