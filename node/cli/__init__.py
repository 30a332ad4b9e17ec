"""The `skillswarm` command line (typer + rich). Each group lives in its own module."""
