"""Files that travel to workers: a script, a %%horovod cell, or the working folder, as a tar.gz.

Workers that do not see the session's files at the same paths (SSH hosts, containers without the
working folder mounted, pods) receive what a program needs as data over the control plane, and
unpack it in a folder of their own. Archives are built in memory, so their size is capped; past
the cap the error names the size and the ways out.

What leaves the working folder: everything but DEFAULT_EXCLUDES and what its `.cmlclusterignore`
(gitignore syntax, read with pathspec) names; a `!` line there takes a default back (`!.env.example`).
The defaults keep home what may hold credentials (SECRET_EXCLUDES: the stores of the usual CLIs, keys,
Jupyter's runtime files, histories; a CML project folder is the user's HOME), and one notice at
WARNING per shipping names what they kept, so that a worker missing a file is never a mystery.
A link that resolves inside the folder travels as a relative link; one that points outside it (a
virtual environment's `bin/python`, `data -> /mnt/...`) would dangle or escape in the worker, so it
stays behind, and one warning names every link left out.

Unpacking refuses the whole archive before writing anything when a member could land outside the
folder: see `unpack`.
"""

from __future__ import annotations

import io
import logging
import os
import posixpath
import shutil
import stat
import tarfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .workers import Program

log = logging.getLogger(__name__)

DEFAULT_LIMIT_MB = 50.0  # per archive; CMLCLUSTER_SHIP_LIMIT_MB changes it
# What may hold credentials, wherever it lies in the folder: a CML project folder is the user's HOME,
# so the stores of the usual CLIs sit in it. Left out, and named in one notice per shipping. Names,
# not contents (gitleaks and trufflehog read contents; a worker's copy must not need either): each
# entry is where a tool keeps a token, a key or what was typed, by its documented default path.
SECRET_EXCLUDES = (
    # cloud and cluster CLIs
    ".aws/", ".azure/", "**/.config/gcloud/", "application_default_credentials.json", ".kube/", ".oci/",
    ".cdp/", ".databrickscfg", ".boto", ".s3cfg", "**/.docker/config.json", "**/.config/containers/auth.json",
    ".vault-token", "**/.terraform.d/credentials.tfrc.json",
    # git, package indexes, hosted services
    ".netrc", "_netrc", ".git-credentials", "**/.config/git/credentials", "**/.config/gh/hosts.yml", ".pypirc",
    ".npmrc", ".yarnrc.yml", "**/.pip/pip.conf", "**/.config/pip/pip.conf", ".condarc", ".dockercfg",
    ".kaggle/", "**/.huggingface/token", "**/.cache/huggingface/token", "**/.cache/huggingface/stored_tokens",
    "**/.streamlit/secrets.toml", ".pgpass", ".my.cnf", ".Renviron", "**/.config/rclone/rclone.conf",
    "**/.dbt/profiles.yml", ".snowsql/",
    # keys and keyrings: private key files by their extensions and ssh-keygen's names (their .pub
    # twins are harmless, and src/id_utils.py or id_rsa_tool.py are code), then all of ~/.ssh (config and
    # known_hosts name the user's hosts), after the `!`, so that nothing in it comes back
    "*.pem", "*.key", "*.p12", "*.pfx", "*.ppk", "*.jks", "*.keystore",
    "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "!id_*.pub", "!id_*.py", "!id_*.ipynb",
    ".ssh/", ".gnupg/", "**/.local/share/keyrings/", "**/.local/share/python_keyring/", ".password-store/",
    # Jupyter's runtime files: the server's token (jpserver-*.json, its -open.html) and each kernel's
    # HMAC key; ipyparallel's connection files; hashed passwords in the server's config
    "**/jupyter/runtime/", "**/Jupyter/runtime/", "jpserver-*.json", "jpserver-*.html", "nbserver-*.json",
    "nbserver-*.html", "jupyter_cookie_secret", "notebook_cookie_secret", "**/.ipython/profile_*/security/",
    "**/.jupyter/jupyter_server_config.json", "**/.jupyter/jupyter_notebook_config.json",
    # environment files, and what was typed: shell and REPL histories (.bash_history, .Rhistory, ...)
    ".env*", ".*history", ".*_history_*", "**/fish/fish_history", "**/.ipython/profile_*/history.sqlite",
    ".lesshst", ".viminfo",
)  # fmt: skip
# What only this machine needs: left out quietly.
LOCAL_EXCLUDES = (".git", "__pycache__")
# The first lines of the ignore spec, so a `!` line in .cmlclusterignore takes one back, as in a
# .gitignore: the user's file is an explicit choice.
DEFAULT_EXCLUDES = LOCAL_EXCLUDES + SECRET_EXCLUDES
IGNORE_FILE = ".cmlclusterignore"
NOTICE_NAMES = 5  # the notice names this many of what it left out, then counts the rest


@dataclass(frozen=True)
class Shipment:
    """Files on their way to workers that do not see them (see plan)."""

    files: bytes  # a tar.gz, or b"" when the workers see everything already
    in_cwd: bool  # unpacked into the worker's own working folder, else into a private folder
    names: dict[str, str]  # a path on the session's machine -> how a program in the worker names it

    def program(self, **fields: Any) -> Program:
        """A Program carrying these files."""
        return Program(files=self.files, files_in_cwd=self.in_cwd, **fields)


def plan(scripts: Iterable[str], working_folder: bool, sees: Callable[[str], bool], cwd: str) -> Shipment:
    """What must travel so that workers can run these scripts (and, if asked, see the working folder).

    `sees(path)`: whether the workers see a path of this machine at that path (the backend's
    Capabilities.sees): nothing travels to them (local processes, a mounted folder).
    """
    in_cwd = not sees(cwd)  # then the worker's working folder is its own
    folder = cwd if working_folder and in_cwd else None
    left_out = _Rules(cwd) if folder is not None else None
    names: dict[str, str] = {}
    files: dict[str, str] = {}
    for script in scripts:
        path = os.path.abspath(script)
        if sees(path):
            names[script] = path
        elif left_out is not None and path.startswith(cwd.rstrip("/") + "/"):
            names[script] = os.path.relpath(path, cwd)  # travels with the folder
            if _is_left_out(left_out, names[script]):
                files[names[script]] = path  # named to run, so it travels even where the folder's rules leave it out
        else:
            name = os.path.basename(path)
            while name in files and files[name] != path:
                name = f"_{name}"  # two scripts of the same name from different folders
            files[name] = path
            names[script] = name
    archive = pack(files, folder) if files or folder else b""
    return Shipment(archive, in_cwd, names)


def limit_bytes() -> int:
    raw = os.environ.get("CMLCLUSTER_SHIP_LIMIT_MB", "")
    try:
        mb = float(raw) if raw else DEFAULT_LIMIT_MB
    except ValueError:
        raise ConfigError(f"CMLCLUSTER_SHIP_LIMIT_MB={raw!r}: give a number of megabytes, e.g. 200") from None
    return int(mb * 1024 * 1024)


def pack(files: Mapping[str, str], folder: str | None = None) -> bytes:
    """A tar.gz of {name in the archive: path on this machine}, and of what ships from `folder`.

    Files are read through links, and hard-linked files travel as files of their own (the
    worker refuses links it cannot check: see unpack).
    """
    contents = _Contents(folder) if folder is not None else None
    if contents is not None:
        contents.check_size()
        contents.notice_secrets()
        contents.warn_left_out()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", dereference=True) as tar:
        if contents is not None:
            for name, path in contents.items:
                tar.add(path, arcname=name, recursive=False)
            for name, target in contents.links:
                info = tarfile.TarInfo(name)
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
                tar.addfile(info)
        for name, path in files.items():
            tar.add(path, arcname=name, recursive=False)
    return _checked(buffer.getvalue(), ", ".join([*([folder] if folder else []), *files.values()]))


def pack_text(name: str, text: str) -> bytes:
    """A tar.gz holding one file made from text (a notebook cell, say)."""
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


class _Rules:
    """What a folder leaves behind: DEFAULT_EXCLUDES, then its .cmlclusterignore (whose `!` lines win).

    Called with a name relative to the folder (a folder's name ends in "/"): whether it is left out
    by itself.
    """

    def __init__(self, folder: str):
        import pathspec  # only the session packs; workers never need it

        self.ignore_file = os.path.join(folder, IGNORE_FILE)
        try:
            with open(self.ignore_file, encoding="utf-8") as f:
                own = f.read().splitlines()
        except FileNotFoundError:
            own = []
        self._all = pathspec.GitIgnoreSpec.from_lines([*DEFAULT_EXCLUDES, *own]).match_file
        self._secret = pathspec.GitIgnoreSpec.from_lines(SECRET_EXCLUDES).match_file
        self._own = pathspec.GitIgnoreSpec.from_lines(own).match_file

    def __call__(self, name: str) -> bool:
        return self._all(name)

    def secret(self, name: str) -> bool:
        """Whether `name` is left out for what it may hold (SECRET_EXCLUDES), not by the user's own lines."""
        return self._all(name) and self._secret(name) and not self._own(name)


def _is_left_out(rules: Callable[[str], bool], name: str, is_folder: bool = False) -> bool:
    """Whether `name` is left out, itself or through one of its folders."""
    parts = name.split("/")
    folders = ["/".join(parts[: i + 1]) + "/" for i in range(len(parts) - 1)]
    return any(rules(f) for f in folders) or rules(name + "/" if is_folder else name)


@dataclass
class _Contents:
    """What ships from a folder: its files and folders, its links that stay inside, what stays behind."""

    folder: str
    items: list[tuple[str, str]] = field(default_factory=list)  # (name in the archive, path): folders, files
    links: list[tuple[str, str]] = field(default_factory=list)  # (name, relative target)
    behind: list[str] = field(default_factory=list)  # links and special files left out, described
    secrets: list[str] = field(default_factory=list)  # what SECRET_EXCLUDES left out ("/" after a folder)
    sizes: dict[str, int] = field(default_factory=dict)  # bytes under each top-level name

    def __post_init__(self) -> None:
        self.root = os.path.realpath(self.folder)
        self.rules = _Rules(self.folder)
        self._scan("")

    def _scan(self, under: str) -> None:
        with os.scandir(os.path.join(self.folder, under)) as found:
            entries = sorted(found, key=lambda e: e.name)
        for entry in entries:
            name = f"{under}{entry.name}"
            # A link is judged by its own name too, as the folder it may point to (`.aws -> ...`).
            as_named = name + "/" if entry.is_dir() else name
            if self.rules(as_named) or (entry.is_symlink() and self.rules(name)):
                if self.rules.secret(as_named) or self.rules.secret(name):
                    self.secrets.append(as_named)
            elif entry.is_symlink():
                self._link(name, entry.path)
            elif entry.is_dir():
                self.items.append((name, entry.path))
                self._scan(name + "/")
            elif entry.is_file():
                self.items.append((name, entry.path))
                top = name.split("/")[0]
                self.sizes[top] = self.sizes.get(top, 0) + entry.stat().st_size
            else:
                self.behind.append(f"{name} (not a file, folder or link)")

    def _link(self, name: str, path: str) -> None:
        target = os.path.realpath(path)  # through every link in a chain
        inside = os.path.relpath(target, self.root)
        if inside == ".." or inside.startswith("../"):
            self.behind.append(f"{name} -> {os.readlink(path)}")
        elif inside != "." and _is_left_out(self.rules, inside, os.path.isdir(target)):
            self.behind.append(f"{name} -> {os.readlink(path)} (left out)")
        else:  # relative to the link's own folder, which is a folder in the archive too
            self.links.append((name, posixpath.relpath("/" + inside, "/" + posixpath.dirname(name))))

    def notice_secrets(self) -> None:
        """Once per shipping, at WARNING: what the defaults kept home, and how to ship one anyway."""
        if not self.secrets:
            return
        more = len(self.secrets) - NOTICE_NAMES
        shown = ", ".join(self.secrets[:NOTICE_NAMES]) + (f" and {more} more" if more > 0 else "")
        log.warning(
            "cmlcluster: not shipped to workers (may hold credentials): %s; in %s a !pattern ships one (e.g. "
            "!%s), a plain pattern keeps it home unsaid",
            shown, self.rules.ignore_file, self.secrets[0],
        )  # fmt: skip

    def warn_left_out(self) -> None:
        if not self.behind:
            return
        shown = ", ".join(self.behind[:10]) + (f" and {len(self.behind) - 10} more" if len(self.behind) > 10 else "")
        warnings.warn(
            f"shipping {self.folder} to workers leaves these behind: {shown}. A link pointing outside the folder "
            "(or to what is left out) would not work in a worker, and fifos, sockets and devices do not travel; "
            "workers that need them must find them at their own paths (a volume, the image)",
            stacklevel=4,
        )

    def check_size(self) -> None:
        """Refuse a folder past the limit before reading it into memory."""
        limit, total = limit_bytes(), sum(self.sizes.values())
        if total <= limit:
            return
        biggest = sorted(self.sizes.items(), key=lambda s: -s[1])[:3]
        most = ", ".join(f"{name} ({size / 2**20:.1f} MB)" for name, size in biggest)
        raise ConfigError(
            f"the working folder {self.folder} holds more than {limit / 2**20:.3g} MB to ship: "
            f"{total / 2**20:.1f} MB, most in {most}; that is too much to ship to every worker over the control "
            f"plane. Leave out what workers do not need in {os.path.join(self.folder, IGNORE_FILE)} (gitignore "
            "syntax), run from a smaller folder, put data where the workers read it (a shared volume, object "
            "storage), or raise CMLCLUSTER_SHIP_LIMIT_MB"
        )


def _checked(archive: bytes, what: str) -> bytes:
    limit = limit_bytes()
    if len(archive) > limit:
        raise ConfigError(
            f"{what}: {len(archive) / 2**20:.1f} MB compressed, more than the {limit / 2**20:.3g} MB that is shipped "
            f"to workers; leave out what they do not need ({IGNORE_FILE}), put large files where the workers read "
            "them, or raise CMLCLUSTER_SHIP_LIMIT_MB"
        )
    return archive


def unpack(archive: bytes, folder: str) -> str:
    """Runs in a worker: unpack into `folder` (made if missing); nothing may land outside it.

    One routine on every Python: tarfile's "data" filter is missing before 3.11.4 (Debian 12 has
    3.11.2), and it checks each member against what the folder holds at that moment, so a link
    made by one member can carry the next one out. Here, before anything is written, the whole
    archive is refused when a member has an absolute name or a `..`, is a hard link, a device or a
    fifo, is a link whose target leaves the folder, or lies under a link of the archive. Then
    folders and files are written, each folder opened without following links (a link already in
    `folder` is never passed through; one in a file's place is replaced), and the links last.
    """
    os.makedirs(folder, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        members = _safe_members(tar, folder)
        writer = _Writer(tar, folder)
        try:
            for parts, member in sorted(members, key=lambda m: m[1].issym()):  # links last
                writer.write(parts, member)
        finally:
            writer.close()
    return folder


class UnsafeArchive(tarfile.TarError):
    """A shipped archive that could write outside the worker's folder."""


def _safe_members(tar: tarfile.TarFile, folder: str) -> list[tuple[tuple[str, ...], tarfile.TarInfo]]:
    """Every member with its path as parts, once all are checked (see unpack)."""
    members, links = [], set()
    for member in tar.getmembers():
        parts = tuple(p for p in member.name.split("/") if p not in ("", "."))
        why = ""
        if member.name.startswith("/"):
            why = "has an absolute name"
        elif ".." in parts:
            why = "has '..' in its name"
        elif member.islnk():
            why = f"is a hard link (to {member.linkname!r})"
        elif member.issym() and not _link_stays_inside(member.linkname, parts[:-1]):
            why = f"is a link to {member.linkname!r}, which leaves the folder"
        elif not (member.isreg() or member.isdir() or member.issym()):
            why = "is a device, a fifo or another special file"
        elif not parts and not member.isdir():
            why = "would replace the folder itself"
        if why:
            raise UnsafeArchive(f"refused the files shipped to {folder}: {member.name!r} {why}; nothing was unpacked")
        if member.issym():
            links.add(parts)
        members.append((parts, member))
    for parts, member in members:
        through = next((parts[:i] for i in range(1, len(parts)) if parts[:i] in links), None)
        if through is not None:
            raise UnsafeArchive(
                f"refused the files shipped to {folder}: {member.name!r} lies under {'/'.join(through)!r}, a link "
                "of the same archive; nothing was unpacked"
            )
    return members


def _link_stays_inside(target: str, folder: tuple[str, ...]) -> bool:
    """Whether a link in `folder` (parts under the root) to `target` points inside the root.

    Lexically: `..` only at the start (after a name, `..` would climb out of wherever that name
    links to), and no more of them than the link is deep.
    """
    if not target or target.startswith("/"):
        return False
    parts = [p for p in target.split("/") if p not in ("", ".")]
    ups = next((i for i, p in enumerate(parts) if p != ".."), len(parts))
    return ".." not in parts[ups:] and ups <= len(folder)


class _Writer:
    """Writes checked members under a folder, through folder descriptors that never follow links."""

    _FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW

    def __init__(self, tar: tarfile.TarFile, folder: str):
        self.tar, self.folder = tar, folder
        # The folder itself may be a link (/tmp on macOS); nothing under it is followed.
        self.fds: dict[tuple[str, ...], int] = {(): os.open(folder, os.O_RDONLY | os.O_DIRECTORY)}

    def write(self, parts: tuple[str, ...], member: tarfile.TarInfo) -> None:
        for held in [k for k in self.fds if k and k != parts[: len(k)]]:  # only this member's folders stay open
            os.close(self.fds.pop(held))
        if member.isdir():
            self._folder(parts, member.name)
            return
        parent, leaf = self._folder(parts[:-1], member.name), parts[-1]
        if member.issym():
            try:
                os.symlink(member.linkname, leaf, dir_fd=parent)
            except FileExistsError:
                self._clear(parent, leaf, member.name)
                os.symlink(member.linkname, leaf, dir_fd=parent)
            return
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        mode = (member.mode & 0o755) | 0o600  # as the data filter: no set-id bits, no write by others
        try:
            fd = os.open(leaf, flags, mode, dir_fd=parent)
        except OSError:  # a link there (O_NOFOLLOW), or a folder
            self._clear(parent, leaf, member.name)
            fd = os.open(leaf, flags, mode, dir_fd=parent)
        with os.fdopen(fd, "wb") as out:
            os.fchmod(fd, mode)
            source = self.tar.extractfile(member)
            if source is not None:
                shutil.copyfileobj(source, out)

    def _clear(self, parent: int, leaf: str, name: str) -> None:
        """Make room for a file or link where an older file or link is (never a folder)."""
        if stat.S_ISDIR(os.stat(leaf, dir_fd=parent, follow_symlinks=False).st_mode):
            raise UnsafeArchive(f"{name!r} was shipped to {self.folder}, where it is a folder already")
        os.unlink(leaf, dir_fd=parent)

    def _folder(self, parts: tuple[str, ...], name: str) -> int:
        """A descriptor of the folder at `parts` (made where missing); never through a link."""
        if parts in self.fds:
            return self.fds[parts]
        parent, leaf = self._folder(parts[:-1], name), parts[-1]
        try:
            fd = os.open(leaf, self._FOLDER, dir_fd=parent)
        except FileNotFoundError:
            os.mkdir(leaf, 0o755, dir_fd=parent)
            fd = os.open(leaf, self._FOLDER, dir_fd=parent)
        except OSError:  # ELOOP: a link; ENOTDIR: a file
            raise UnsafeArchive(
                f"{name!r} was shipped to {self.folder}, where {'/'.join(parts)!r} is a link or a file, not a folder"
            ) from None
        self.fds[parts] = fd
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
