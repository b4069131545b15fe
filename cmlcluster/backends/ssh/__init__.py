"""The SSH backend: workers on hosts reached over SSH, machines the user already has.

On the session's side:
- ``backend``: SSHBackend (``use_backend("ssh", hosts=[...], ...)``)
- ``attach``: a worker's connections to its relay, one after another as they drop
- ``collect``: collect= files streamed home from the host once the worker's connection ended

On each host (``python -m cmlcluster.backends.ssh.remote``, one per worker):
- ``remote``: starts the worker's relay out of the ssh login, and carries connections to it
- ``relay``: the worker's parent: keeps it and its output when the connection drops
- ``janitor``: cleans up after a relay that was killed (kill -9, the OOM killer)

The SSH pieces the backends share with Horovod's workers (keys, config, sshd) are in ``cmlcluster.ssh``.
"""
