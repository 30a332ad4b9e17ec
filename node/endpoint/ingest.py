"""`skillswarm ingest`: logged agent traces with scores (JSONL) into a trajectory store, as training groups.

One line per trajectory: `messages` (OpenAI format, ending with the model's last turn), `reward`, and
optionally `group_id` (else: the hash of the opening, so runs of one prompt group together),
`trajectory_id`, `turn_rewards`, `correct`, `reason`. A line may carry its exact `token_ids`,
`loss_mask` and sampling `logprobs` (an export of this endpoint's store); otherwise the conversation is
tokenized with the model's chat template and its logprobs are computed with the model at
`temperature`: logged traces have no sampling logprobs, so they are treated as samples of the model
they are ingested for (the importance ratio starts at 1). The whole file is checked before anything is
written: a bad line is reported with its number and nothing lands.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from skillswarm.node.endpoint.messages import RequestError, to_internal
from skillswarm.node.endpoint.store import append_lines, open_store
from skillswarm.node.rl.records import (
    GROUPS_FILE,
    Call,
    GroupRecord,
    Segment,
    Trajectory,
    check_reward,
    encode_line,
    opening_key,
)
from skillswarm.protocol.errors import SkillswarmError
from skillswarm.protocol.hashing import weights_hash
from skillswarm.skills.chat import episode_tokens

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 16 << 20


class IngestError(SkillswarmError):
    """A trace file line that cannot be ingested; the message names the line and the fix."""


@dataclass
class IngestResult:
    trajectories: int
    groups: int
    single_groups: int
    scored_with_model: int


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _parse(number: int, raw: bytes, tokenizer: Any, max_context: int, vocab: int) -> tuple[dict[str, Any], Segment]:
    where = f"line {number}"
    try:
        row = json.loads(raw)
    except ValueError as e:
        raise IngestError(f"{where}: not JSON ({e})") from None
    if not isinstance(row, dict):
        raise IngestError(f"{where}: each line must be a JSON object with messages and reward")
    try:
        row["reward"] = check_reward(row.get("reward"))
        internal = to_internal(row.get("messages"))  # type: ignore[arg-type]
    except (ValueError, RequestError) as e:
        raise IngestError(f"{where}: {e}") from None
    if not any(m.role == "assistant" for m in internal):
        raise IngestError(f"{where}: the conversation has no assistant turn to train on")
    conversation = [(m.role, m.content) for m in internal]
    if "token_ids" in row:
        ids, mask, lps = row.get("token_ids"), row.get("loss_mask"), row.get("logprobs")
        if not (isinstance(ids, list) and isinstance(mask, list) and isinstance(lps, list) and len(ids) == len(mask) == len(lps)):
            raise IngestError(f"{where}: token_ids, loss_mask and logprobs must be lists of one length")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids) or any(m not in (0, 1) for m in mask):
            raise IngestError(f"{where}: token ids must be in [0, {vocab}) and the loss mask 0 or 1")
        if any(not isinstance(x, (int, float)) or not -1e4 <= x <= 0 for x in lps):
            raise IngestError(f"{where}: logprobs must be numbers <= 0")
        segment = Segment(list(ids), list(mask), [float(x) for x in lps], conversation, conversation)
    else:
        try:
            ids, mask = episode_tokens(tokenizer, internal)
        except Exception as e:
            raise IngestError(f"{where}: the model's chat template cannot render it ({e})") from None
        segment = Segment(ids, mask, [], conversation, conversation)
    if len(segment.token_ids) > max_context:
        raise IngestError(f"{where}: {len(segment.token_ids)} tokens, over the model's context of {max_context}")
    turns = row.get("turn_rewards")
    if turns is not None:
        try:
            row["turn_rewards"] = [check_reward(r, "turn_rewards[]") for r in turns]
        except (TypeError, ValueError) as e:
            raise IngestError(f"{where}: {e}") from None
    for key in ("group_id", "trajectory_id", "reason"):
        if row.get(key) is not None and not isinstance(row[key], str):
            raise IngestError(f"{where}: {key} must be a string")
    if row.get("correct") is not None and not isinstance(row["correct"], bool):
        raise IngestError(f"{where}: correct must be true or false")
    return row, segment


def _score_logprobs(model: Any, segments: list[Segment], temperature: float) -> None:
    """Behaviour logprobs of the model's tokens under `model` at `temperature` (one sequence at a time)."""
    from skillswarm.node.rl.trainer import token_logprobs

    with torch.no_grad():
        for seg in segments:
            ids = torch.tensor([seg.token_ids], dtype=torch.long)
            lp = token_logprobs(model, ids, torch.ones_like(ids), temperature)[0].tolist()
            seg.logprobs = [0.0] + [v if m else 0.0 for v, m in zip(lp, seg.loss_mask[1:])]


def ingest(path: Path, store_dir: Path, model_dir: Path, name: str, temperature: float = 1.0,
           progress: Callable[[int, int], None] | None = None) -> IngestResult:
    """Check every line of `path`, then append its trajectories to the store as closed groups."""
    from skillswarm.node.rl.engines.hf import load_model_dir

    if not 0 < temperature <= 2:
        raise IngestError("temperature must be in (0, 2]: the logprobs are of a sampling distribution")
    try:
        lines = Path(path).expanduser().read_bytes().splitlines()
    except OSError as e:
        raise IngestError(f"cannot read {path}: {e.strerror}") from None
    model, tokenizer = load_model_dir(model_dir)
    max_context = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    parsed = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        if len(raw) > MAX_LINE_BYTES:
            raise IngestError(f"line {number}: over {MAX_LINE_BYTES >> 20} MiB")
        parsed.append(_parse(number, raw, tokenizer, max_context, len(tokenizer)))
        if progress is not None:
            progress(number, len(lines))
    if not parsed:
        raise IngestError(f"{path} holds no trajectories")
    need = [seg for _, seg in parsed if not seg.logprobs]
    _score_logprobs(model.float(), need, temperature)
    now = time.time()
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    seen: set[str] = set()
    for i, (row, seg) in enumerate(parsed):
        gid = row.get("group_id") or opening_key(name, seg.conversation)
        tid = row.get("trajectory_id") or f"ingest-{int(now)}-{i}"
        if tid in seen:
            raise IngestError(f"trajectory_id {tid!r} appears twice")
        seen.add(tid)
        spans = _spans(seg.loss_mask)
        turns = row.get("turn_rewards") or []
        if turns and len(turns) != len(spans):
            raise IngestError(f"trajectory {tid}: turn_rewards has {len(turns)} entries for {len(spans)} model turns")
        reward = row["reward"] + sum(turns)
        calls = [Call(0, a, b, 0, temperature, "stop", now) for a, b in spans]
        groups[gid].append(Trajectory(id=tid, group=gid, name=name, created=now, updated=now, segments=[seg], calls=calls,
                                      status="scored", reward=reward, turn_rewards=turns,
                                      correct=row["correct"] if row.get("correct") is not None else reward > 0,
                                      reason=row.get("reason"), scored_by="ingest"))
    directory = open_store(store_dir, weights_hash(Path(model_dir)), name)
    records = [GroupRecord(id=gid, name=name, closed_at=now, reason="ingest", trajectories=trajs) for gid, trajs in groups.items()]
    append_lines(directory / GROUPS_FILE, [encode_line(r) for r in records])
    return IngestResult(trajectories=len(parsed), groups=len(records), single_groups=sum(len(t) < 2 for t in groups.values()),
                        scored_with_model=len(need))
