"""`skillswarm net dashboard`: a local web page that shows the network live, from a client peer that stays
joined. A thread refreshes one snapshot (`skillswarm.node.network.view.snapshot`: what `net status |
peers | skills | deltas | checkpoints --json` print) every few seconds; the page (one file shipped in the
package, no CDN) fetches it from /api/snapshot and draws tables and a per-skill accuracy chart.
"""

from __future__ import annotations

import logging
import threading
import time
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from skillswarm.node.network.view import snapshot
from skillswarm.protocol.records import NetworkSpec

log = logging.getLogger(__name__)

PAGE = "dashboard.html"
DEFAULT_REFRESH_S = 3.0


class Watcher(threading.Thread):
    """Keeps the latest snapshot of the network (and the last error, if gathering one failed)."""

    def __init__(self, dht: Any, spec: NetworkSpec, joined: list[str], refresh_s: float = DEFAULT_REFRESH_S) -> None:
        super().__init__(name="dashboard-watcher", daemon=True)
        self.dht, self.spec, self.joined, self.refresh_s = dht, spec, joined, refresh_s
        self.stop = threading.Event()
        self.latest: dict[str, Any] | None = None
        self.error: str | None = None

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.latest, self.error = snapshot(self.dht, self.spec, self.joined), None
            except Exception as e:  # a DHT hiccup: keep the last view, say what went wrong
                self.error = f"{type(e).__name__}: {e}"
                log.warning("dashboard refresh failed: %s", self.error)
            self.stop.wait(self.refresh_s)


def create_app(watcher: Watcher) -> FastAPI:
    """The page and its JSON."""
    app = FastAPI(title="skillswarm dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    page = (resources.files("skillswarm.node.network") / "static" / PAGE).read_text(encoding="utf-8")
    page = page.replace("__REFRESH_MS__", str(int(watcher.refresh_s * 1000)))

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return page

    @app.get("/api/snapshot")
    async def api_snapshot() -> Any:
        if watcher.latest is None:
            return JSONResponse({"error": watcher.error or "joining the network; the first view is on its way"},
                                status_code=503)
        return {**watcher.latest, "error": watcher.error, "age_s": round(time.time() - watcher.latest["time"], 1)}

    return app
