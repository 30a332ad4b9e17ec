"""The one hashing helper: streaming sha256 of files and bytes, and the canonical hash of a state
dict (names, dtypes, shapes and bytes; independent of tensor order and of how files are sharded)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

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


class StateDictHasher:
    """The canonical state-dict hash, fed one tensor at a time (and one chunk of rows at a time), so a
    checkpoint can be hashed while it streams. Tensors must arrive in sorted-name order."""

    def __init__(self) -> None:
        self._h = hashlib.sha256(b"skillswarm/state-dict/v1\n")
        self._last: str | None = None

    def begin(self, name: str, dtype: "torch.dtype", shape: Sequence[int]) -> None:
        """Start tensor `name` (its header: name, dtype, shape)."""
        if self._last is not None and name <= self._last:
            raise ValueError(f"tensor `{name}` hashed after `{self._last}`; feed tensors in sorted-name order")
        self._last = name
        dt = str(dtype).removeprefix("torch.")
        self._h.update(f"{len(name)}:{name}|{dt}|{','.join(str(d) for d in shape)}|".encode())

    def update(self, chunk: "torch.Tensor") -> None:
        """The next bytes (rows) of the current tensor."""
        import torch

        if chunk.numel():
            t = chunk.detach().to("cpu").contiguous().reshape(-1)
            self._h.update(memoryview(t.view(torch.uint8).numpy()))

    def add(self, name: str, tensor: "torch.Tensor") -> None:
        """A whole tensor."""
        self.begin(name, tensor.dtype, tensor.shape)
        self.update(tensor)

    def hexdigest(self) -> str:
        """The digest so far."""
        return self._h.hexdigest()


def state_dict_hash(state: Mapping[str, "torch.Tensor"]) -> str:
    """Canonical sha256 of a state dict: sorted names, each with dtype, shape and raw bytes."""
    h = StateDictHasher()
    for name in sorted(state):
        h.add(name, state[name])
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
    h = StateDictHasher()
    for name in sorted(owner):
        h.add(name, handles[owner[name]].get_tensor(name))
    return h.hexdigest()


def weights_hash(model_dir: Path | str) -> str:
    """The state-dict hash of a Hugging Face model directory's safetensors weights (all shards)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return safetensors_hash(files)
