"""The Docker backend: workers as containers on one engine, each with its own IP on the session's network.

- ``backend``: DockerBackend (``use_backend("docker", image=..., ...)``)
- ``engine``: the engine beneath it: client, worker image, networks, GPU requests, orphans' cleanup
- ``worker``: what one worker's container is made of: user, privileges, environment, files, mounts (pure)
- ``ranges``: an address range for a session's network, chosen as the engine's own allocator chooses
- ``gateway``: a session network's gateway, shut to the containers of every other network
- ``reaper``: removes a session's containers and network when its process ends without closing it
- ``collect``: collect= files copied out of a stopped container before its end is reported
"""
