"""collect=: what a run's workers bring home into the session's working folder, on every backend.

- ``paths``: the paths a user names and which files of them count (both sides read it)
- ``home``: the session's side: files written home safely, what stayed behind said once
- ``on_host``: on an SSH host: a worker's files kept aside as its folder goes, until the session takes them
- ``in_worker``: in a worker whose folder the backend cannot reach (a pod): its files, handed over by its agent
- ``through_agents``: the session's side of that: taken over the control plane before the worker stops

How each backend brings them is the backend's own: ``backends.ssh.collect``, ``backends.docker.collect``.
"""
