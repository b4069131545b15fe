"""CML's web apps in workers, and links a browser opens to them through the notebook server.

- ``ports``: CDSW_APP_PORT, CDSW_READONLY_PORT, CDSW_PUBLIC_PORT and each worker's ``app_url``
- ``forward``: in a worker, a relay from its own address to the app listening on its loopback
- ``server_proxy``: links through jupyter-server-proxy (a worker's app_url, a TensorBoard)
- ``proxy_hosts``: which hosts jupyter-server-proxy may reach: this user's running workers, nothing else
"""
