"""The Kubernetes backend (issue 13): workers as pods, one per-session Secret that owns them.

The backend class will live here. ``manifests`` builds the Pod and Secret manifests as plain
dicts (the JSON the API takes): pure functions, no kubernetes client and no API calls, so they
are printed and tested without a cluster.
"""
