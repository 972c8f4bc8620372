"""The timeline page: `/ui/` serves a static single-page app (HTML, CSS, vanilla JS shipped in
`gateway/ui_static/`, nothing fetched from the network) that reads the workflow API.

Only the files shipped in the package are served, by exact name: a request for anything else,
including `..` paths and encoded slashes, is a 404 before any filesystem access.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

from gateway.errors import GatewayError

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
"""The asset kinds the page ships; files of any other kind are not served."""

SECURITY_HEADERS = {
    # Scripts and styles only from the page's own files: text from a workflow (task ids,
    # errors) can never run even if it reached the DOM as markup.
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "img-src 'self' data:; connect-src 'self'; "
                                "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class AssetNotFound(GatewayError):
    """No asset of the timeline page by that name."""

    status = 404
    err_type = "invalid_request_error"
    code = "asset_not_found"


def load_assets() -> dict[str, tuple[bytes, str]]:
    """Every shipped asset by file name: its bytes and content type."""
    out: dict[str, tuple[bytes, str]] = {}
    for item in resources.files("gateway").joinpath("ui_static").iterdir():
        suffix = "." + item.name.rsplit(".", 1)[-1] if "." in item.name else ""
        if item.is_file() and suffix in CONTENT_TYPES:
            out[item.name] = (item.read_bytes(), CONTENT_TYPES[suffix])
    return out


class TimelineUI:
    """Serves the timeline page from the assets loaded at start-up."""

    def __init__(self) -> None:
        self.assets = load_assets()
        if "index.html" not in self.assets:
            raise RuntimeError("the timeline page's index.html is missing from the package")

    def routes(self, app: web.Application) -> None:
        """Register `/ui` (redirect), `/ui/` (the page) and `/ui/static/{name}`."""
        app.router.add_get("/ui", self.handle_redirect)
        app.router.add_get("/ui/", self.handle_index)
        app.router.add_get("/ui/static/{name}", self.handle_asset)

    def _serve(self, name: str) -> web.Response:
        body, content_type = self.assets[name]
        return web.Response(body=body, headers={"Content-Type": content_type,
                                                **SECURITY_HEADERS})

    async def handle_redirect(self, request: web.Request) -> web.Response:
        """GET /ui: to /ui/ (keeping the query), so the page's relative links resolve."""
        query = f"?{request.query_string}" if request.query_string else ""
        raise web.HTTPFound(f"/ui/{query}")

    async def handle_index(self, _: web.Request) -> web.Response:
        """GET /ui/: the page."""
        return self._serve("index.html")

    async def handle_asset(self, request: web.Request) -> web.Response:
        """GET /ui/static/{name}: one shipped file, by exact name."""
        name = request.match_info["name"]
        if name not in self.assets:
            raise AssetNotFound(f"no timeline asset named {name!r}")
        return self._serve(name)
