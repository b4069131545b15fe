"""torchrun, with its failures written down for the session:

    python -m cmlcluster.pytorch.launch REPORT [torchrun's arguments...]

The same as ``torchrun [arguments]`` (torch.distributed.run's own parser and run()), except
that when processes fail, each failed process's global rank, local rank, exit code, message
and traceback are written to REPORT as JSON instead of being printed as a Python traceback.
"""

from __future__ import annotations

import json
import os
import sys
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


def main(argv: list[str]) -> None:
    report, arguments = argv[0], argv[1:]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ["CMLCLUSTER_TORCHRUN_PID"] = str(os.getpid())  # each process dies with this one (rank.py)
    try:
        run(parse_args(arguments))
    except ChildFailedError as e:
        with open(report, "w") as f:
            json.dump(failures_of(e), f)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
