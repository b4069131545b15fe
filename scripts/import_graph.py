"""cmlcluster's import graph: which module imports which, any circle, and any arrow that points up.

    python scripts/import_graph.py          # the graph, one module a line
    python scripts/import_graph.py --check  # exit 1 on a circle or an upward arrow (a unit test runs it)

Every import is an arrow: a lazy one inside a function, and one under `if TYPE_CHECKING:` too. An
annotation names what a module depends on as surely as a call does; a type-only import up a layer is
a dependency the layers deny, which a protocol below it (viewers.ViewedSession, supervision.WorkerCalls)
states instead.
"""

from __future__ import annotations

import ast
import itertools
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "cmlcluster"

# Each module's layer, lowest first; a module imports its own layer or lower ones. The longest
# prefix that matches a module's name (without "cmlcluster.") decides.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "errors",
            "checks",
            "_version",
            "_lazy",
            "wire",
            "_aio",
            "blocking",  # a call that holds the notebook's cell, and ending it from another thread
            "_exit",
            "_lifeline",
            "_proc",
            "_redact",  # secrets out of log records (the controller and the agent)
            "origin",
            "ports",
            "apps.server_proxy",  # links through the notebook server's jupyter-server-proxy
            "apps.ports",  # CML's web-app ports and app_url: a worker dict's field
            "cml_shim",  # the finder that answers for `cml` where no real CML is installed
            "workers",
            "collect.paths",  # what collect= may name, and which files are a worker's: both sides read it
            "resources",
            "cgroups",
            "collect",  # the collect= package: its __init__ is its list of modules
            "apps",  # the web-apps package: its __init__ is its list of modules
            "agent.engine_imports",  # what a worker's engine leaves unimported: before the engine's import
            "events",
            "live",
            "shipping",
            "progress",
            "usage",  # what a worker uses: sampled by its agent, read back by the session
            "lines",
            "logfile",
            "viewers",  # how a session is shown: the UI registers with it, the session calls it
            "session_summary",  # a session's notebook and outcome, beside its kept logs
            "stop_socket",  # a session's stop socket: served by the session (records), asked by the panel (lab)
            "control.controller",
            "ssh",
            "ssh.config",
            "ssh.keys",
            "ssh.client",  # the one ssh command line: the ssh backend's and the slurm backend's login node
            "ssh.preflight",
            "horovod.commands",
            "socket_owners",  # whose a TCP socket on this machine is: the rendezvous and the app forwarder ask
            "horovod.rendezvous",  # the elastic rendezvous' key and peer check: in horovodrun's driver and each rank
            "pytorch.commands",
            "pytorch.store",  # torch's TCPStore on one address: in workers, and as the session's process
            "pytorch.rendezvous",  # torchrun's c10d rendezvous with signed state: in each node's torchrun
            "tensorflow.layout",
            "tensorflow.versions",
            "tensorflow.coordinator",
            "tensorflow.internals",
            "control.ipyparallel_internals",
            "probes",
            "control.connection",
            "stacks",  # an X-ray's report (both sides read its records) and the hook each rank arms
        ),
    ),
    # A worker's side: its agent and what runs beside it. Nothing here knows a session.
    (
        "worker",
        (
            "agent",
            "collect.in_worker",  # in a pod's agent: its collect= files, for the session to take
            "apps.forward",  # relays a worker's own address to its web app on 127.0.0.1
            "runs.entry",  # what a rank runs (a script, a function), for every framework's rank runner
            "runs.node_process",  # a node's launcher on its worker, for every framework of one node per worker
            "pytorch.node",
            "pytorch.rank",
            "pytorch.launch",
            "accelerate.launch",
            "jax.node",
            "jax.process",
            "horovod.rank",
            "horovod.driver",
            "tensorflow.task",
            "ssh.sshd",
            "backends.ssh.remote",
            "backends.ssh.relay",  # the host's side of an SSH worker, beside its remote
            "backends.ssh.janitor",  # cleans up after a killed relay on an SSH host
            "collect.on_host",  # on an SSH host: a worker's collect= files, kept until the session takes them
            "stacks.gather",  # the stacks of a worker's program and ranks, gathered by its agent
        ),
    ),
    # What a session drives: the control plane (it runs one function of the agent in the worker) and backends.
    (
        "drivers",
        ("control", "backends", "backends.registry", "collect.home"),  # collect.home: what backends bring home
    ),
    (
        "session parts",
        (
            "supervisor",
            "waiting",
            "idle",  # idle_timeout= and ttl=: the supervisor's clock of each worker's idleness
            "stragglers",  # the session's watch of its reporters' pace
            "worker_env",
            "runtime",
            "records",
            "worker_logs",
            "leftovers",
            "collect.through_agents",
            "tensorboard_server",
            "tensorboard_process",
            "supervision",  # what the supervisor's parts may do with its workers
        ),
    ),
    ("session", ("session",)),
    # The views, above the session they show (typed against viewers.ViewedSession); the face registers them.
    ("views", ("ui",)),
    ("jobs", ("jobs", "runs", "api")),
    ("frameworks", ("tensorflow", "horovod", "pytorch", "jax", "accelerate")),
    # "": the package itself; cml_shim.cml: CML's `cml` package, over api.
    ("faces", ("magics", "demo", "__main__", "", "cml_shim.cml", "lab", "apps.proxy_hosts")),
]


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}."""
    mods = modules()
    edges: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                subs = [f"{module}.{alias.name}" for alias in node.names]
                targets = [s for s in subs if s in mods] + ([module] if any(s not in mods for s in subs) else [])
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = itertools.count()

    def visit(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> int:
    """The layer of the longest prefix in LAYERS that names the module or a package holding it."""
    short = module.removeprefix("cmlcluster").removeprefix(".")
    matches = [
        (len(prefix), rank)
        for rank, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if short == prefix or (prefix and short.startswith(prefix + "."))
    ]
    if not matches:
        raise LookupError(f"{module} is in no layer of scripts/import_graph.py: add it to LAYERS")
    return max(matches)[1]


def upward(edges: dict[str, set[str]]) -> list[str]:
    return [
        f"{a} ({LAYERS[layer(a)][0]}) -> {b} ({LAYERS[layer(b)][0]})"
        for a in sorted(edges)
        for b in sorted(edges[a])
        if layer(b) > layer(a)
    ]


def main(argv: list[str]) -> int:
    edges = graph()
    problems = [f"circle: {' <-> '.join(c)}" for c in cycles(edges)] + [f"upward: {u}" for u in upward(edges)]
    if "--check" not in argv:
        for module in sorted(edges):
            print(f"{module} -> {', '.join(sorted(edges[module])) or '-'}")
        print(f"{len(edges)} modules, {sum(map(len, edges.values()))} arrows")
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
