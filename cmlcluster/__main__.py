"""cmlcluster on the command line; the progress shows as in a notebook (tqdm bars on a terminal).

cmlcluster demo          the main job: parameter-server training on local workers
cmlcluster run-cluster   a TensorFlow cluster whose worker tasks run a script
cmlcluster horovod       a script under horovodrun on fresh workers
cmlcluster torchrun      a script under torchrun (PyTorch distributed) on fresh workers
cmlcluster jaxrun        a script as one JAX process on each of fresh workers
cmlcluster accelerate    an Accelerate script on fresh workers, one machine each
cmlcluster list          the sessions running on this machine, and their workers (--watch: what they use, live)
cmlcluster top           the same as list --watch
cmlcluster logs          the workers' logs, kept after their session (which sessions, without one)
cmlcluster backends      where workers can run, and each backend's options
cmlcluster cleanup       end what sessions that no longer run left behind
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from .backends import Backend, add_backend_arguments, backend_from, backends_help
from .errors import CmlClusterError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cmlcluster", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    demo = commands.add_parser("demo", help="the main job: parameter-server training of a Keras model")
    demo.add_argument("--workers", type=int, default=2)
    demo.add_argument("--ps", type=int, default=1, help="parameter servers")
    demo.add_argument("--epochs", type=int, default=15)
    add_backend_arguments(demo)
    demo.add_argument("--timeout", type=float, default=120, help="seconds for the workers to start")

    cluster = commands.add_parser(
        "run-cluster",
        help="a TensorFlow cluster whose worker tasks run a script",
        description="Start n parameter servers and workers; every worker task runs SCRIPT: Cloudera's "
        "run(cluster, server, task_index) by default, or as a program with TF_CONFIG set (--tf-config).",
    )
    cluster.add_argument("script")
    cluster.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments (with --tf-config)")
    cluster.add_argument("--workers", type=int, default=2)
    cluster.add_argument("--ps", type=int, default=1, help="parameter servers")
    cluster.add_argument("--cpu", type=float, default=1, help="cores per task")
    cluster.add_argument("--memory", type=float, default=1, help="GB per task")
    cluster.add_argument("--gpus", type=int, default=0, help="GPUs per worker task")
    cluster.add_argument("--tf-config", action="store_true", help="run the script as a program, with TF_CONFIG")
    add_backend_arguments(cluster)
    cluster.add_argument("--timeout", type=float, default=120, help="seconds for the tasks to start")

    from .runs.verbs import VERBS, add_verb_arguments, options_of

    for verb in VERBS:
        add_verb_arguments(commands.add_parser(verb, help=options_of(verb).HELP), verb, magic=False, with_script=True)

    listing = commands.add_parser("list", help="the sessions running on this machine (any backend) and their workers")
    listing.add_argument(
        "--watch",
        action="store_true",
        help="every second, what each live session's workers use (CPU, memory, GPUs) beside what they asked for; "
        "Ctrl-C ends it",
    )
    commands.add_parser("top", help="the same as list --watch")
    logs = commands.add_parser(
        "logs",
        help="a session's worker logs, kept after it ended (without SESSION: the sessions kept)",
        description="Print the workers' logs of SESSION (an id, or the start of one), or of one of its "
        "workers (its id, or its number). Kept: the last 50 sessions, 14 days, 2 GiB in all; none with "
        "CMLCLUSTER_KEEP_LOGS=0.",
    )
    logs.add_argument("session", nargs="?")
    logs.add_argument("worker", nargs="?")
    logs.add_argument("--tail", type=int, metavar="N", help="only the last N lines of each log")
    logs.add_argument("--delete", action="store_true", help="remove SESSION's kept logs instead (or --all)")
    logs.add_argument("--all", action="store_true", help="with --delete: every session's that no longer runs")
    commands.add_parser("backends", help="where workers can run, and each backend's options (--backend-option)")

    cleanup = commands.add_parser(
        "cleanup", help="end what sessions that no longer run left: worker processes and containers, folders"
    )
    cleanup.add_argument("--dry-run", action="store_true", help="say what would be ended, end nothing")
    cleanup.add_argument(
        "--namespace", help="the Kubernetes namespace to look in (default: the kubeconfig's, or this pod's)"
    )

    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from . import demo as main_job

            return main_job.run(args.workers, args.ps, args.epochs, _backend(args), args.timeout)
        if args.command == "run-cluster":
            return run_cluster(args)
        if args.command in VERBS:
            return int(options_of(args.command).run(args, args.script, args.args).exit_code)
        if args.command == "list" and not args.watch:
            return list_sessions()
        if args.command in ("list", "top"):
            return watch_sessions()
        if args.command == "logs":
            from . import worker_logs

            if args.delete or args.all:
                if not args.delete or args.worker is not None or args.tail is not None:
                    parser.error("logs: --all goes with --delete, which takes a SESSION or --all and nothing else")
                return worker_logs.delete(args.session, args.all)
            return worker_logs.show(args.session, args.worker, args.tail)
        if args.command == "backends":
            print(backends_help())
            return 0
        return cleanup_sessions(args.dry_run, args.namespace)
    except CmlClusterError as e:
        print(f"cmlcluster {args.command}: {e}", file=sys.stderr)
        return 2


def _backend(args: argparse.Namespace) -> str | Backend:
    return backend_from(args) or os.environ.get("CMLCLUSTER_BACKEND", "local")


def run_cluster(args: argparse.Namespace) -> int:
    from .session import Session
    from .tensorflow import start_cluster
    from .tensorflow.cluster import check_script

    script = check_script(args.script)  # before the session starts anything
    with Session(_backend(args)) as session:
        # With TF_CONFIG the script starts its own server (MultiWorkerMirrored, or a TF1 script).
        cluster = start_cluster(
            args.workers, args.ps, args.cpu, args.memory, args.gpus, session=session,
            servers=not args.tf_config, coordinator=False, timeout_seconds=args.timeout,
        )  # fmt: skip
        with cluster:
            if args.tf_config:
                results = cluster.run_script(script, args.args)
            else:
                results = cluster.run_cml_script(script)
        failed = [r for r in results if r["status"] != "succeeded"]
        print(f"{len(results) - len(failed)} of {len(results)} worker tasks succeeded")
        return 1 if failed else 0


def list_sessions() -> int:
    from . import records
    from .demo import table

    found = records.records()
    if not found:
        print("no cmlcluster sessions on this machine")
        return 0
    for record in found:
        age = time.time() - record.get("started", time.time())
        print(
            f"session {record['id']}  pid {record.get('pid')}  {record.get('backend')}  up {age:.0f} s{_note(record)}"
        )
        workers = record.get("workers", [])
        if workers:
            rows = [("worker", "id", "status", "address", "host", "exit_code")]
            rows += [
                (_label(w), w["id"], w["status"], str(w["ip_address"]), w.get("hostname") or "", str(w["exit_code"]))
                for w in workers
            ]
            print("  " + table(rows).replace("\n", "\n  "))
    return 0


# How often `list --watch` reads the records again (a session rewrites its own at most once a second).
WATCH_SECONDS = 1.0


def watch_sessions(seconds: float = WATCH_SECONDS) -> int:
    """`list --watch`: the live sessions' workers and what they use, again every `seconds`, until Ctrl-C
    (or SIGTERM), which ends it with exit code 0. On a terminal each refresh replaces the last."""
    import signal

    # The handler only flips a flag: an Event's set() takes a lock that the main thread may hold in its
    # wait() when the signal lands (Python runs handlers between its bytecodes), and it would wait forever.
    stopping: list[int] = []
    ending = {sig: signal.signal(sig, lambda sig, _: stopping.append(sig)) for sig in (signal.SIGINT, signal.SIGTERM)}
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    try:
        while not stopping:
            screen = usage_screen(_live_records(), time.time())
            try:
                sys.stdout.write(f"{clear}{screen}\n" if clear else f"{screen}\n\n")
                sys.stdout.flush()
            except BrokenPipeError:  # `cmlcluster top | head`: its reader has what it wanted
                with contextlib.suppress(OSError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 0
            deadline = time.monotonic() + seconds
            while not stopping and time.monotonic() < deadline:
                time.sleep(min(0.1, seconds))
    finally:
        for sig, handler in ending.items():
            signal.signal(sig, handler)
    return 0


def _live_records() -> list[dict[str, Any]]:
    from . import origin, records

    # probe=False: telling a gone session from one whose controller still answers takes a connection, up to
    # a second each, that this never needs; a refresh waited out 30 s of them in a CI run, Ctrl-C unheard.
    return [r for r in records.records(probe=False) if r["state"] == origin.ALIVE]


def usage_screen(found: list[dict[str, Any]], now: float) -> str:
    """One refresh of `list --watch`: per session, its workers' status and what each asked for and uses, in
    the words of the notebook's views (ui/model.resource_texts: CPU in % of one core, memory against its
    limit, GPUs' utilization and memory). A record says what the session last wrote (at most once a
    second): a worker without a sample yet, or one that ended, shows only what it asked for."""
    from .demo import table
    from .ui.model import resource_texts

    sessions = f"{len(found)} live session{'s' if len(found) != 1 else ''}"
    lines = [f"cmlcluster: {sessions}, {time.strftime('%H:%M:%S', time.localtime(now))} (Ctrl-C ends)"]
    for record in found:
        age = now - record.get("started", now)
        lines.append(f"session {record['id']}  pid {record.get('pid')}  {record.get('backend')}  up {age:.0f} s")
        workers = record.get("workers", [])
        if not workers:
            continue
        rows = [("worker", "id", "status", "cpu", "memory", "gpus")]
        rows += [(_label(w), str(w["id"]), str(w["status"]), *resource_texts(w)) for w in workers]
        lines += [f"  {row}".rstrip() for row in table(rows).splitlines()]
    return "\n".join(lines)


def _label(worker: dict[str, Any]) -> str:
    """The worker's name in the session's views: its job's ("ps 0"), else w<n>."""
    from .worker_env import worker_label

    return worker_label(str(worker["id"]), worker.get("label"))


def _note(record: dict[str, Any]) -> str:
    """What `list` and `cleanup` say after a session, by its state (origin.py)."""
    from . import origin

    state = record["state"]
    if state == origin.GONE:
        return "  (its process is gone: `cmlcluster cleanup` ends what it left)"
    if state == origin.ANSWERING:
        controller = record.get("controller")
        return f"  (its process looks gone, but its controller at {controller} answers: cleanup leaves it)"
    if state == origin.ELSEWHERE:
        where = record.get("host") or "an unknown host"
        return f"  (of {where}, another PID namespace or boot, or an older cmlcluster: cleanup leaves it)"
    return ""


def cleanup_sessions(dry_run: bool, namespace: str | None = None) -> int:
    from . import origin, records

    verb = "would end" if dry_run else "ended"
    found = records.records()
    for record in found:
        if record["state"] not in (origin.GONE, origin.ALIVE):
            print(f"session {record['id']}: left alone{_note(record)}")
    done = records.clean_gone(found, dry_run)
    done += [f"{verb} {what}" for what in records.backend_leftovers(dry_run, {"namespace": namespace}, _warn)]
    for line in done:
        print(line)
    if not done:
        print("nothing to clean up: no session that is gone left anything here")
    return 0


def _warn(message: str) -> None:
    print(message, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
