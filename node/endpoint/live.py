"""Training behind the API: an endpoint that serves the trainer's newest weights, and a source that
trains on what it records (`train --skill external:NAME --serve PORT`).

The endpoint runs on its own engine copy in the training process; after every optimizer step the
trainer publishes its weights to a mailbox, and the endpoint's engine thread loads them between
generation batches, so every recorded completion names the policy version that produced it and the
trainer's staleness bound and importance-sampling correction apply as to its own rollouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any, Callable

from skillswarm.node.endpoint.limits import DEFAULT_HOST, StoreLimits
from skillswarm.node.endpoint.service import EndpointService
from skillswarm.node.endpoint.store import TrajectoryStore, open_store
from skillswarm.node.rl.groups import Batch
from skillswarm.node.rl.store_source import StoreSource
from skillswarm.skills.skill import Skill

log = logging.getLogger(__name__)

Publish = Callable[[Any, int], None]


def trainer_endpoint(model_dir: Path, engine_kind: str, device: str, store_dir: Path, name: str, trainer: Any,
                     max_new_tokens: int, skill: Skill | None = None) -> tuple[EndpointService, Publish]:
    """An endpoint on its own engine copy of `model_dir`, recording into `store_dir` under `name`; the
    returned publish function hands it new weights (applied before its next generation batch)."""
    from skillswarm.node.rl.engines import load_engine
    from skillswarm.node.rl.sources import Mailbox
    from skillswarm.protocol.hashing import weights_hash

    engine = load_engine(engine_kind, model_dir, device=device)
    mailbox = Mailbox()
    if trainer.version > 0:  # a resumed run serves its own weights, not the base's
        mailbox.publish(trainer.engine_weights(), trainer.version)
    directory = open_store(store_dir, weights_hash(Path(model_dir)), name)
    service = EndpointService(engine, TrajectoryStore(directory, name, StoreLimits()), Path(model_dir).name, skill,
                              before_batch=lambda: mailbox.apply(engine), max_new_tokens=max_new_tokens)
    return service, mailbox.publish


class LiveSource:
    """Serves the endpoint while the run lasts; batches are the groups it records, as they close."""

    def __init__(self, service: EndpointService, port: int, reader: StoreSource, host: str = DEFAULT_HOST) -> None:
        self.service, self.port, self.reader, self.host = service, port, reader, host
        self.stack = contextlib.ExitStack()
        self.url = ""

    async def start(self) -> None:
        from skillswarm.node.endpoint.serve import running

        self.url = await asyncio.to_thread(self.stack.enter_context, running(self.service, self.host, self.port))
        log.warning("serving the trained policy at %s (recording as %s into %s); train --serve trains on what it "
                    "records", self.url, self.service.store.name, self.service.store.dir)

    async def next_batch(self) -> Batch:
        return await self.reader.next_batch()

    async def close(self) -> None:
        await asyncio.to_thread(self.stack.close)  # stops the server; the service closes its queue and store


def live_source(cfg: Any, trainer: Any, run_dir: Path, device: str, skill: Skill | None, start_batch: int,
                should_stop: Callable[[], bool]) -> tuple[LiveSource, Publish]:
    """The source of `train --skill external:NAME --serve PORT` and the publish function for its weights."""
    name = cfg.external_name()
    store_dir = cfg.store if cfg.store is not None else run_dir / "store"
    service, publish = trainer_endpoint(cfg.model_dir, cfg.engine, device, store_dir, name, trainer, cfg.max_new_tokens,
                                        skill)
    reader = StoreSource(store_dir, name, cfg.batch, cfg.loss, cfg.temperature, start_batch,
                         wait_s=cfg.store_wait_s or float("inf"), should_stop=should_stop)
    return LiveSource(service, cfg.serve_port, reader), publish
