"""What an X-ray costs the job it looks into: four PyTorch ranks on two local workers each run a fixed number
of allreduce steps, alone and while the notebook takes an X-ray every second (py-spy attaches to each rank
for the instant it reads it; the faulthandler path signals it), alternating in the same process. Printed:
each X-ray's median time, the job's median seconds each way and their ratio (goal <= 1.05).

    python bench/xray_cost.py [--steps 3000] [--repeat 3] [--every 1.0] [--no-py-spy]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

from cmlcluster import Session, run_torch
from cmlcluster.wire import PY_SPY_ENV

STEPS = """\
import sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1000)
for _ in range(int(sys.argv[1])):
    dist.all_reduce(t)
"""


def job(script: str, steps: int, every: float | None, env: dict[str, str], xrays: list[float]) -> float:
    """Seconds of one run of the job, with an X-ray every `every` seconds while it runs (None: none)."""
    with Session("local", echo=False) as session:
        done = threading.Event()

        def look() -> None:
            while not done.wait(every):
                if any(w["status"] == "running" for w in session.list_workers()):
                    started = time.perf_counter()
                    session.xray()
                    xrays.append(time.perf_counter() - started)

        looking = threading.Thread(target=look, daemon=True) if every else None
        if looking:
            looking.start()
        started = time.perf_counter()
        result = run_torch(script, [str(steps)], nnodes=2, nproc_per_node=2, env=env, session=session, echo=False)
        seconds = time.perf_counter() - started
        done.set()
        assert result.ok, result.message
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--every", type=float, default=1.0)
    parser.add_argument("--no-py-spy", action="store_true", help="read the ranks through their faulthandler dumps")
    args = parser.parse_args()
    env = {PY_SPY_ENV: "0"} if args.no_py_spy else {}
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "steps.py")
        with open(script, "w") as f:
            f.write(STEPS)
        alone, looked, xrays = [], [], []
        for _ in range(args.repeat):
            alone.append(job(script, args.steps, None, env, xrays))
            looked.append(job(script, args.steps, args.every, env, xrays))
    print(f"{len(xrays)} X-rays, median {statistics.median(xrays) * 1000:.0f} ms each")
    alone_s, looked_s = statistics.median(alone), statistics.median(looked)
    print(f"job alone {alone_s:.2f} s, with an X-ray every {args.every:g} s {looked_s:.2f} s")
    print(f"ratio {looked_s / alone_s:.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
