"""The one hashing helper: streaming sha256 of files and bytes, and the canonical hash of a state
dict (names, dtypes, shapes and bytes; independent of tensor order and of how files are sharded)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

if TYPE_CHECKING:
    import torch

CHUNK = 1 << 20


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of a byte string."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path | str, chunk_size: int = CHUNK) -> str:
    """Hex sha256 of a file, read in chunks so memory stays flat for any size."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            h.update(block)
    return h.hexdigest()


def _update_tensor(h: "hashlib._Hash", name: str, tensor: "torch.Tensor") -> None:
    import torch

    t = tensor.detach().to("cpu").contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    shape = ",".join(str(d) for d in t.shape)
    h.update(f"{len(name)}:{name}|{dtype}|{shape}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def state_dict_hash(state: Mapping[str, "torch.Tensor"]) -> str:
    """Canonical sha256 of a state dict: sorted names, each with dtype, shape and raw bytes."""
    h = hashlib.sha256(b"skillswarm/state-dict/v1\n")
    for name in sorted(state):
        _update_tensor(h, name, state[name])
    return h.hexdigest()


def safetensors_hash(paths: Iterable[Path | str]) -> str:
    """`state_dict_hash` of the tensors in one or more safetensors files, one tensor in memory at a time."""
    from safetensors import safe_open

    handles = [safe_open(str(p), framework="pt") for p in paths]
    owner: dict[str, int] = {}
    for i, f in enumerate(handles):
        for name in f.keys():
            if name in owner:
                raise ValueError(f"tensor `{name}` appears in more than one file")
            owner[name] = i
    h = hashlib.sha256(b"skillswarm/state-dict/v1\n")
    for name in sorted(owner):
        _update_tensor(h, name, handles[owner[name]].get_tensor(name))
    return h.hexdigest()


def weights_hash(model_dir: Path | str) -> str:
    """The state-dict hash of a Hugging Face model directory's safetensors weights (all shards)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return safetensors_hash(files)
