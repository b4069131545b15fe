"""The Kubernetes backend (issue 13): workers as pods, one per-session Secret that owns them.

``backend`` holds KubernetesBackend (``use_backend("kubernetes", image=..., ...)``), which talks to
the API through the official client; ``manifests`` builds the Pod and Secret manifests as plain
dicts (the JSON the API takes): pure functions, no client and no API calls, so they are printed
and tested without a cluster.
"""
