"""The Kubernetes backend (issue 13): workers as pods, one per-session Secret that owns them.

``backend`` holds KubernetesBackend (``use_backend("kubernetes", image=..., ...)``), which talks to
the API through the official client, with ``preflight`` (the checks before anything starts) and
``watch`` (what happens to the session's pods, from one watch of them).

Pure, and tested without a cluster: ``manifests`` builds the Pod and Secret manifests as plain
dicts (the JSON the API takes), from ``names`` (names, labels, Kubernetes' rules for them) and
``options`` (PodOptions, SharedVolume: what a user chooses for every pod); ``pods`` reads what the
API answers (a pod's state, why it ended).
"""

from .options import PodOptions, SharedVolume

__all__ = ["PodOptions", "SharedVolume"]
