"""The control plane: how the session talks to its workers once they run (ipyparallel).

- ``plane``: ControlPlane, the session's side: the controller it owns, the client, calls into agents
- ``controller``: the entry point of the session's controller process
- ``connection``: the controller's connection files: which channels listen where, the keys that guard them
- ``ipyparallel_internals``: every name of ipyparallel (and ipykernel) beyond their documented API we rely on
"""
