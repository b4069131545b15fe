"""What a worker starts with: its ids, its command line and its environment (the one build_spec).

The user's variables come first and cmlcluster's own override them; a backend on the
session's own host adds the session's environment (Capabilities.session_host), no other
backend sees it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from . import wire
from .apps.ports import environment as app_ports_env
from .backends import Capabilities
from .workers import PACKAGE_DIR, PACKAGE_PARENT, Resources, WorkerSpec


def worker_id(session_id: str, engine_id: int) -> str:
    return f"{session_id}-{engine_id}"


def short_label(worker: str) -> str:
    """ "w3" for the worker "<session id>-3": how views, the panel and the CLI name a worker that no job
    names (a job's member is "ps 0", "node 1"); the id itself when it is not one of worker_id's."""
    session, _, engine = worker.rpartition("-")
    return f"w{engine}" if session and engine.isdigit() else worker


def worker_label(worker: str, named: str | None = None, *, role: str = "", index: int | None = None) -> str:
    """A worker's name wherever one is shown (views, records, the panel, the CLI): the name already given
    it (`named`, as a record keeps it), else its job's (`role` and `index`: "ps 0"), else short_label's."""
    if named:
        return named
    if role and index is not None:
        return f"{role} {index}"
    return short_label(worker)


def build_spec(
    *,
    session_id: str,
    engine_id: int,
    resources: Resources,
    env: Mapping[str, str],
    cwd: str,
    agent_env: Mapping[str, str],
    controller_ip: str,
    capabilities: Capabilities,
    session_environ: Mapping[str, str] = os.environ,
    replaces: str = "",
    collect: tuple[str, ...] = (),
    name: str = "",
    app_ports: tuple[int, ...] = (),
) -> WorkerSpec:
    """The spec a backend starts one worker from. Pure: everything it reads is an argument."""
    wid = worker_id(session_id, engine_id)
    worker_env = dict(env)
    worker_env.update(agent_env)
    worker_env.update(app_ports_env(app_ports))  # CML's web-app ports (apps/ports.py)
    worker_env.update(
        {
            "CDSW_MASTER_IP": controller_ip,
            "CML_MASTER_IP": controller_ip,
            "CDSW_MASTER_ID": session_id,
            "CDSW_ENGINE_ID": wid,
            wire.ENGINE_ID_ENV: str(engine_id),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if not capabilities.sees(cwd):
        worker_env[wire.OWN_FOLDER_ENV] = "1"  # it starts in a folder of its own (see agent_files.leftovers)
        if collect:
            worker_env[wire.COLLECT_ENV] = json.dumps(list(collect))
    if capabilities.sees(PACKAGE_DIR):
        # Workers that see this checkout import the same cmlcluster as the session, installed or not.
        inherited = env.get("PYTHONPATH", session_environ.get("PYTHONPATH", "") if capabilities.session_host else "")
        worker_env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, inherited) if p)
    return WorkerSpec(
        worker_id=wid,
        engine_id=engine_id,
        argv=(capabilities.python, "-m", "cmlcluster.agent"),
        env=worker_env,
        resources=resources,
        cwd=cwd,
        replaces=replaces,
        collect=collect,
        name=name,
        app_ports=app_ports,
    )
