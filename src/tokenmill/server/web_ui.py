"""The web playground and live dashboard at `/` (turned off by --disable-web-ui).

Plain HTML, CSS and JavaScript modules from the package's `web/` folder, served by the engine's
own server: no CDN and no build step, so the page works offline. The page and its assets load
without the API key (a browser cannot send a Bearer header for a page it navigates to); every
call the page makes for data (/v1/models, /v1/chat/completions, /metrics) sends the key typed
into its key field, so with --api-key set nothing is shown or generated without it. Every URL in
the page is relative, so it also works under --root-path behind a proxy.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB_DIR = Path(__file__).with_name("web")
ASSETS = "/ui"  # the page's scripts and styles


def is_public(path: str) -> bool:
    """The page and its static assets (no data in them): open without the API key."""
    return path == "/" or path.startswith(ASSETS + "/")


def install(app: FastAPI) -> None:
    app.mount(ASSETS, StaticFiles(directory=WEB_DIR), name="ui")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})
