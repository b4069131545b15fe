"""The Slurm backend: workers as Slurm jobs, placed by the cluster's own scheduler.

On the session's side (a Slurm submit host):
- ``backend``: SlurmBackend (``use_backend("slurm", partition=..., ...)``): one srun per worker
- ``commands``: what is said to Slurm and read back, as data: srun's options, squeue's and sinfo's lines
- ``queue``: the session's jobs in Slurm's queue, one squeue for the session every few seconds

On each node (``python -m cmlcluster.backends.slurm.task``, the job's step):
- ``task``: runs the worker's agent in a private folder, and ends all it started when the step ends
"""
