"""Pure merging: methods, streaming merge over safetensors, delta codecs, screening. No network code.

The API other parts call (see each module for details):

- trainer:     compute_delta(base_dir, tuned_dir, out_path, codec, ...) / encode_delta(state, out_path, codec, ...)
               -> DeltaInfo (sha256, size, norm, num_tensors, codec, params: a DeltaManifest's fields)
- coordinator: screen_deltas(base_dir, candidates, base_hash=, max_norm_ratio=) -> ScreenResult
               merge_checkpoint(base_dir, {skill: [(delta_path, weight)]}, policy, out_dir, delta_out=...)
               -> MergeResult (weights_hash, files, delta)
               round_merge(parent_dir, [RoundDelta], policy, out_dir, seed=...) -> MergeResult: a round's merge,
               as the coordinator makes it and `--verify` recomputes it (included_deltas reads one from a manifest)
- worker:      apply_delta(base_dir, merged_delta, out_dir) -> MergeResult (bit-identical to the coordinator's)
- anyone:      read_delta(path), analyze_deltas(paths), merge_deltas / merge_models (plain N-input merges)

Layout: methods/ (one file per method + registry), aggregate.py (intra-skill), codecs.py (per tensor), exact.py
(the bit-stable arithmetic every hashed computation uses),
deltas.py (delta files), peft_format.py (LoRA deltas that are PEFT adapters), tensorfile.py + checkpoint.py
(safetensors and HF directories), pipeline.py (chunked execution, apply), streaming.py (the merge), rounds.py (a
round's merge recipe), screening.py, diagnostics.py, recipe.py.
"""

from skillswarm.merge.deltas import DeltaFile, DeltaInfo, compute_delta, encode_delta, read_delta
from skillswarm.merge.diagnostics import DeltaReport, analyze_deltas, plot_report
from skillswarm.merge.pipeline import MergeResult, apply_delta
from skillswarm.merge.rounds import RoundDelta, included_deltas, round_merge
from skillswarm.merge.screening import DeltaCandidate, ScreenResult, screen_deltas
from skillswarm.merge.streaming import MergeInput, MergeSpec, merge_checkpoint, merge_deltas, merge_models

__all__ = [
    "DeltaCandidate", "DeltaFile", "DeltaInfo", "DeltaReport", "MergeInput", "MergeResult", "MergeSpec",
    "RoundDelta", "ScreenResult", "analyze_deltas", "apply_delta", "compute_delta", "encode_delta",
    "included_deltas", "merge_checkpoint", "merge_deltas", "merge_models", "plot_report", "read_delta",
    "round_merge", "screen_deltas",
]
