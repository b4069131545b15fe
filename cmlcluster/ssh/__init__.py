"""SSH, done safely, in one place: used by Horovod (sshd in workers) and the SSH-hosts backend.

- keys.py: a fresh ed25519 identity per session, its files (known_hosts, ssh config, an ssh that
  never skips the host key check), removed at teardown;
- config.py: pure builders of known_hosts lines and ssh config text;
- sshd.py: runs inside a worker: a key-only sshd admitting only the session's key, as the worker's
  own user (root or not);
- preflight.py: log in to every host at once with paramiko before anything depends on it.
"""
