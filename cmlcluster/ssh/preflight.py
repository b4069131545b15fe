"""Log in to hosts before anything depends on them, all at once, with paramiko.

One error lists every host that cannot be reached, with its reason, so a user fixes them all at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import CmlClusterError

CHECK_TIMEOUT = 10.0


@dataclass(frozen=True)
class Login:
    host: str
    port: int
    user: str


def check_logins(logins: Sequence[Login], identity_file: str, known_hosts: str, what: str = "hosts") -> None:
    """Log in to each with this key, checking host keys against known_hosts only; run `true` there."""
    import paramiko

    def try_login(login: Login) -> str | None:
        client = paramiko.SSHClient()
        client.load_host_keys(known_hosts)
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            client.connect(
                login.host,
                port=login.port,
                username=login.user,
                key_filename=identity_file,
                look_for_keys=False,
                allow_agent=False,
                timeout=CHECK_TIMEOUT,
                banner_timeout=CHECK_TIMEOUT,
                auth_timeout=CHECK_TIMEOUT,
            )
            _, stdout, _ = client.exec_command("true", timeout=CHECK_TIMEOUT)
            if stdout.channel.recv_exit_status() != 0:
                return "logged in, but cannot run commands"
            return None
        except paramiko.BadHostKeyException:
            return "its host key is not the one pinned for this session (refusing: possible impostor)"
        except paramiko.SSHException as e:
            return f"SSH refused: {e}"
        except OSError as e:
            return f"cannot connect to port {login.port}: {e.strerror or e}"
        finally:
            client.close()

    with ThreadPoolExecutor(max_workers=min(32, len(logins))) as pool:
        problems = {login: p for login, p in zip(logins, pool.map(try_login, logins), strict=True) if p}
    if problems:
        listing = "\n".join(f"  {login.user}@{login.host}:{login.port}: {why}" for login, why in problems.items())
        raise CmlClusterError(f"{len(problems)} of {len(logins)} {what} cannot be reached by SSH:\n{listing}")
