"""The panel's REST API under {base_url}cmlcluster/, in the Jupyter server's process.

    GET  sessions                       {"now", "live": [...], "kept": [...]} (sessions.snapshot)
    POST sessions/<id>/stop             {"workers": "all" | [ids]} -> {"stopping": [ids]}
    GET  logs/<session id>/<worker id>  ?bytes=N (default 64 KiB, at most 1 MiB) -> the log's tail
    POST cleanup                        -> {"done": [lines]}: what gone sessions left, ended

Every handler is jupyter_server's APIHandler: authenticated as the server's other APIs are (token or
cookie, `@web.authenticated`), authorized through the server's authorizer (`@authorized`, resource
"cmlcluster": GET is read, POST write), and a POST without the XSRF token a cookie login needs is
refused by jupyter_server itself. The work (files, sockets, a controller probe) runs on a thread, so a
slow disk never stalls the server's loop.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from ..errors import ConfigError
from . import sessions

AUTH_RESOURCE = "cmlcluster"


class Handler(APIHandler):
    auth_resource = AUTH_RESOURCE

    @property
    def root_dir(self) -> str:
        return str(self.settings.get("cmlcluster_root_dir", ""))

    def body(self) -> dict[str, Any] | None:
        """The request's JSON object; None when it is none (the client was told so)."""
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError as e:
            self.refuse(400, f"the request's body is not JSON: {e}")
            return None
        if not isinstance(body, dict):
            self.refuse(400, f"the request's body is a {type(body).__name__}, not a JSON object")
            return None
        return body

    def refuse(self, status: int, message: str) -> None:
        """An error as jupyter_server's APIs send theirs ({"message": ...}), written here rather than
        raised as an HTTPError, whose message tornado would %-format (a worker id may hold a %)."""
        self.set_status(status)
        self.finish(json.dumps({"message": message}))

    async def answer(self, call: Any, *args: Any) -> None:
        try:
            result = await asyncio.to_thread(call, *args)
        except sessions.NotFound as e:
            return self.refuse(404, str(e))
        except ConfigError as e:
            return self.refuse(400, str(e))
        self.finish(json.dumps(result))


class SessionsHandler(Handler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        await self.answer(sessions.snapshot, self.root_dir)


class StopHandler(Handler):
    @web.authenticated
    @authorized
    async def post(self, session_id: str) -> None:
        body = self.body()
        if body is None:
            return
        workers = body.get("workers", "all")
        if workers != "all" and not (isinstance(workers, list) and all(isinstance(w, str) for w in workers)):
            return self.refuse(400, f'workers={workers!r}: give "all" or a list of worker ids')
        await self.answer(_stop, session_id, None if workers == "all" else workers)


def _stop(session_id: str, workers: list[str] | None) -> dict[str, list[str]]:
    return {"stopping": sessions.stop(session_id, workers)}


class LogHandler(Handler):
    @web.authenticated
    @authorized
    async def get(self, session_id: str, worker_id: str) -> None:
        asked = self.get_argument("bytes", str(sessions.LOG_BYTES))
        if not (asked.isascii() and asked.isdigit()):  # "²".isdigit() is true, and int() refuses it
            return self.refuse(400, f"bytes={asked!r}: give a number of bytes")
        await self.answer(sessions.log_tail, session_id, worker_id, int(asked))


class CleanupHandler(Handler):
    @web.authenticated
    @authorized
    async def post(self) -> None:
        await self.answer(_cleanup)


def _cleanup() -> dict[str, list[str]]:
    return {"done": sessions.cleanup()}


def add_handlers(server_app: Any) -> None:
    web_app = server_app.web_app
    contents = getattr(server_app, "contents_manager", None)
    web_app.settings["cmlcluster_root_dir"] = str(getattr(contents, "root_dir", "") or server_app.root_dir)
    base = url_path_join(web_app.settings["base_url"], "cmlcluster")
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base, "sessions"), SessionsHandler),
            (url_path_join(base, r"sessions/([0-9a-f]{16})/stop"), StopHandler),
            (url_path_join(base, r"logs/([0-9a-f]{16})/([0-9a-f]{16}-[0-9]+)"), LogHandler),
            (url_path_join(base, "cleanup"), CleanupHandler),
        ],
    )
