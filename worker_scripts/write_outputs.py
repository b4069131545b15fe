"""A worker's results, written to outputs/ in its working folder, for collect=:

    workers = cdsw.launch_workers(2, cpu=0.5, memory=1, script="worker_scripts/write_outputs.py", collect="outputs")

Each worker writes outputs/<its worker id>.txt. Where workers share the notebook's folder (local workers,
CML) that is the notebook's outputs/; where they have folders of their own (Docker, SSH hosts, pods),
collect="outputs" brings each worker's files there as it ends.
"""

import os
import socket

worker = os.environ["CDSW_ENGINE_ID"]
os.makedirs("outputs", exist_ok=True)
path = os.path.join("outputs", f"{worker}.txt")
with open(path, "w") as f:
    f.write(f"written by worker {worker} on {socket.gethostname()}\n")
print("wrote", path)
