"""torchrun, with its failures written down for the session:

    python -m cmlcluster.pytorch.launch REPORT [HOST:PORT TIMEOUT] -- [torchrun's arguments...]

The same as ``torchrun [arguments]`` (torch.distributed.run's own parser and run()), except
that when processes fail, each failed process's global rank, local rank, exit code, message
and traceback are written to REPORT as JSON ({"failures": [...]}) instead of being printed as a
Python traceback. Given HOST:PORT (on every node but node 0 of a static run), it first waits
until the rendezvous there accepts connections, after importing torch, so that the wait and the
import overlap; one it cannot reach within TIMEOUT seconds is written to REPORT as {"error": ...}.
Node 0 of a static run hosts the rendezvous store, on its master address only (store.py); an
elastic run's is the session's, and its state is signed with the run's key (rendezvous.py), which this
process takes out of its environment before torchrun starts any process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any


def failures_of(error: Any) -> list[dict[str, Any]]:
    """ChildFailedError.failures ({global rank: ProcessFailure}) as JSON-able records, first one first."""
    records = []
    for rank, failure in error.failures.items():
        # With an error file (torch's record(), as cmlcluster.pytorch.rank runs every process) the
        # message is {"message": ..., "extraInfo": {"py_callstack": ...}}; without one, a sentence.
        message = failure.message
        details: dict[str, Any] = message if isinstance(message, dict) else {"message": str(message)}
        records.append(
            {
                "rank": int(rank),
                "local_rank": failure.local_rank,
                "exit_code": failure.exitcode,
                "pid": failure.pid,
                "message": str(details.get("message", "")),
                "traceback": str(details.get("extraInfo", {}).get("py_callstack", "")),
                "timestamp": failure.timestamp,
            }
        )
    first_rank, _ = error.get_first_failure()
    records.sort(key=lambda r: (r["rank"] != first_rank, r["timestamp"]))
    return records


def main(argv: list[str], configure: Callable[[argparse.Namespace], None] | None = None) -> None:
    """torchrun with argv (see the module's docstring); configure(torchrun's arguments), when given, runs
    before torchrun does (Accelerate's launch sets its environment there: cmlcluster.accelerate.launch)."""
    split = argv.index("--")
    report, wait_for, arguments = argv[0], argv[1:split], argv[split + 1 :]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from cmlcluster.ports import wait_until_accepting
    from cmlcluster.pytorch import rendezvous
    from cmlcluster.pytorch.store import listening_store

    key = rendezvous.take_key()  # out of the environment that the ranks inherit
    if key is not None:
        rendezvous.register(key)
    if wait_for:
        host, _, port = wait_for[0].rpartition(":")
        try:
            wait_until_accepting(host, int(port), float(wait_for[1]))
        except TimeoutError as e:
            _write(report, {"error": f"the rendezvous was not reached: {e}"})
            sys.exit(1)
    os.environ["CMLCLUSTER_TORCHRUN_PID"] = str(os.getpid())  # each process dies with this one (rank.py)
    args = parse_args(arguments)
    if configure is not None:
        configure(args)
    os.environ.pop(rendezvous.RUN_ID_ENV, None)  # read (args.rdzv_id); the ranks have TORCHELASTIC_RUN_ID
    static_host = args.rdzv_backend == "static" and args.node_rank == 0
    store = listening_store(args.master_addr, args.master_port) if static_host else None
    try:
        run(args)
    except ChildFailedError as e:
        _write(report, {"failures": failures_of(e)})
        sys.exit(1)
    finally:
        del store  # open until torchrun is done


def _write(report: str, content: dict[str, Any]) -> None:
    with open(report, "w") as f:
        json.dump(content, f)


if __name__ == "__main__":
    main(sys.argv[1:])
