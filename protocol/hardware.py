"""What this machine is, for the Hardware part of a PeerRecord (so others know what a peer can do)."""

from __future__ import annotations

import os

from skillswarm.protocol.records import Hardware


def probe_hardware() -> Hardware:
    """CPU count and RAM always; the first accelerator when torch sees one (CUDA or Apple MPS)."""
    import psutil

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
    ram_gb = round(psutil.virtual_memory().total / 2**30, 1)
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return Hardware(device="cuda", accelerator=props.name[:256], accelerator_mem_gb=round(props.total_memory / 2**30, 1),
                            cpu_count=cpus, ram_gb=ram_gb)
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return Hardware(device="mps", accelerator="Apple MPS", cpu_count=cpus, ram_gb=ram_gb)
    except ImportError:
        pass
    return Hardware(device="cpu", cpu_count=cpus, ram_gb=ram_gb)
