"""Command line: ``cmlcluster demo`` runs the main job on the local default;
``cmlcluster cleanup`` removes containers left by sessions that no longer run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

DEMO_CODE = """\
import os, socket, time
total = sum(i * i for i in range(2_000_000))
print(f"worker {os.environ['CDSW_ENGINE_ID']} on {socket.gethostname()} "
      f"({os.environ['CDSW_IP_ADDRESS']}, pid {os.getpid()}) computed {total}")
"""


def _table(workers: list[dict]) -> str:
    rows = [("id", "status", "ip_address", "exit_code", "duration")]
    rows += [(w["id"], w["status"], w["ip_address"], str(w["exit_code"]), str(w["duration"])) for w in workers]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)


def demo(workers: int, backend: str, timeout: float) -> int:
    from .session import Session

    with Session(backend) as session:
        print(f"session {session.id}: launching {workers} workers on the {backend!r} backend")
        launched = session.launch_workers(workers, cpu=0.5, memory=0.5, code=DEMO_CODE)
        running = session.await_workers(launched, wait_for_completion=False, timeout_seconds=timeout)
        print(_table(running["workers"] + running["failures"]))
        done = session.await_workers(launched, wait_for_completion=True, timeout_seconds=timeout)
        print(_table(done["workers"] + done["failures"]))
        for failure in done["failures"]:
            print(f"FAILED {failure.get('id', '(not launched)')}: {failure.get('message')}", file=sys.stderr)
        session.stop_workers()
        print(f"stopped; {len(done['workers'])} of {workers} workers succeeded")
        return 0 if not done["failures"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cmlcluster", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo", help="launch a few workers, show their status, addresses and output, stop them"
    )
    demo_parser.add_argument("-n", "--workers", type=int, default=3)
    demo_parser.add_argument("--backend", default="local")
    demo_parser.add_argument("--timeout", type=float, default=120)
    cleanup_parser = commands.add_parser(
        "cleanup", help="remove worker containers whose session process is gone (on this host)"
    )
    cleanup_parser.add_argument("--dry-run", action="store_true", help="list them, remove nothing")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args.workers, args.backend, args.timeout)
    if args.command == "cleanup":
        return cleanup(args.dry_run)
    return 2


def cleanup(dry_run: bool) -> int:
    from .backends import docker

    names = docker.cleanup(dry_run=dry_run)
    for name in names:
        print(f"{'would remove' if dry_run else 'removed'} {name}")
    if not names:
        print("nothing to clean up: every cmlcluster container belongs to a running session")
    return 0


if __name__ == "__main__":
    sys.exit(main())
