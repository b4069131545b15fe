"""The tests' harness: what the run owns, what tests run on, and the checks that nothing is left.

- identity.py: the run's tag and folders, set before anything reads them
- isolation.py: what every test leaves as it found it (signal handlers, the default session)
- run.py: the run as a whole: file order, the bystander, the subreaper, the end's sweep
- leaks.py: after each test, nothing it started left (processes, containers, temp folders, SSH hosts)
- fixtures.py: backends, sessions, a real IPython shell, the SSH hosts, the stand-in Kubernetes cluster
- processes.py: the run's own processes and containers, the only place that finds them
- sshhosts.py: three SSH hosts, containers with their own IPs and key-only sshd
- kernels.py: Jupyter kernels for the notebook tests
- docker_window.py, bystander.py, aborts_at_exit.py, horovod_scripts.py, tf_training.py, readme_blocks.py:
  what single tests need
"""
