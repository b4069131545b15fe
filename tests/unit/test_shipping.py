"""What travels to workers that do not see the session's files, and what is refused."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import pytest

from cmlcluster import Session
from cmlcluster.backends import Capabilities
from cmlcluster.backends.fake import FakeBackend
from cmlcluster.errors import ConfigError
from cmlcluster.shipping import pack, unpack


def remote(shared: tuple[str, ...] = ()) -> FakeBackend:
    return FakeBackend(
        capabilities=Capabilities(own_address=True, session_host=False, python="python3", shared_paths=shared)
    )


def test_a_script_travels_only_to_workers_that_do_not_see_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("print('hi')")
    other = tmp_path / "elsewhere" / "train.py"
    other.parent.mkdir()
    other.write_text("print('other')")
    with Session(remote(), echo=False) as s:
        shipment = s.ship([str(script), str(other)])
        assert shipment.in_cwd  # the worker's folder is its own: files go there
        assert shipment.names == {str(script): "train.py", str(other): "_train.py"}
        out = tmp_path / "worker"
        unpack(shipment.files, str(out))
        assert sorted(p.name for p in out.iterdir()) == ["_train.py", "train.py"]
        assert (out / "_train.py").read_text() == "print('other')"
    with Session(remote(shared=(str(tmp_path),)), echo=False) as s:  # a mounted folder: nothing travels
        assert s.ship([str(script)]).files == b""
        assert s.ship([str(script)]).names == {str(script): str(script)}
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    with Session(remote(shared=(str(tmp_path / "work"),)), echo=False) as s:
        shipment = s.ship([str(script)])  # the worker's folder is the session's: never unpack there
        assert not shipment.in_cwd and shipment.names == {str(script): "train.py"}


def test_the_working_folder_travels_on_request_with_its_scripts_by_relative_name(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "job.py").write_text("")
    (tmp_path / "data.csv").write_text("1,2\n")
    monkeypatch.chdir(tmp_path)
    with Session(remote(), echo=False) as s:
        shipment = s.ship(["pkg/job.py"], working_folder=True)
        assert shipment.names == {"pkg/job.py": "pkg/job.py"}
        out = tmp_path.parent / f"{tmp_path.name}-unpacked"
        unpack(shipment.files, str(out))
        assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["data.csv", "pkg", "pkg/job.py"]
        monkeypatch.setenv("CMLCLUSTER_SHIP_LIMIT_MB", "0.000001")
        with pytest.raises(ConfigError, match=r"holds more than .* MB.*CMLCLUSTER_SHIP_LIMIT_MB"):
            s.ship([], working_folder=True)
        monkeypatch.setenv("CMLCLUSTER_SHIP_LIMIT_MB", "lots")
        with pytest.raises(ConfigError, match="CMLCLUSTER_SHIP_LIMIT_MB='lots'"):
            s.ship(["pkg/job.py"])


def test_pack_keeps_names_and_contents(tmp_path):
    (tmp_path / "a.py").write_text("A")
    out = tmp_path / "out"
    unpack(pack({"b.py": str(tmp_path / "a.py")}), str(out))
    assert (out / "b.py").read_text() == "A"


def shipped(folder, monkeypatch, to: str = "worker") -> tuple[list[str], list[str]]:
    """What a worker that does not see `folder` gets of it, in `to` beside it: (every name, the warnings)."""
    monkeypatch.chdir(folder)
    with warnings.catch_warnings(record=True) as caught, Session(remote(), echo=False) as s:
        warnings.simplefilter("always")
        shipment = s.ship([], working_folder=True)
    out = folder.parent / to
    unpack(shipment.files, str(out))
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    return names, [str(w.message) for w in caught]


def test_links_inside_the_folder_travel_as_relative_links_and_those_outside_stay_behind(tmp_path, monkeypatch):
    work = tmp_path / "work"
    (work / "runs" / "1").mkdir(parents=True)
    (work / "runs" / "1" / "model.bin").write_bytes(b"weights")
    (work / "latest").symlink_to("runs/1")  # a folder, relative
    (work / "runs" / "1" / "model.copy").hardlink_to(work / "runs" / "1" / "model.bin")  # a file of its own
    (work / "best.bin").symlink_to(work / "runs" / "1" / "model.bin")  # absolute, but inside
    (work / "data").symlink_to(tmp_path)  # outside
    (work / "python").symlink_to(sys.executable)
    (work / "chain").symlink_to("data")  # inside, to a link pointing outside
    (work / "secret").symlink_to(".env")  # to what is left out
    (work / ".env").write_text("TOKEN=1")
    os.mkfifo(work / "pipe")
    names, warned = shipped(work, monkeypatch)
    assert names == ["best.bin", "latest", "runs", "runs/1", "runs/1/model.bin", "runs/1/model.copy"]
    out = tmp_path / "worker"
    assert os.readlink(out / "latest") == "runs/1" and os.readlink(out / "best.bin") == "runs/1/model.bin"
    assert (out / "latest" / "model.bin").read_bytes() == (out / "runs/1/model.copy").read_bytes() == b"weights"
    [warning] = warned  # one, naming each
    for left in [f"data -> {tmp_path}", f"python -> {sys.executable}", "chain -> data", "secret -> .env (left out)"]:
        assert left in warning
    assert "pipe (not a file, folder or link)" in warning


def test_a_folder_with_a_virtual_environment_ships(tmp_path, monkeypatch):
    work = tmp_path / "project"
    (work / ".venv" / "bin").mkdir(parents=True)
    (work / ".venv" / "lib" / "site-packages").mkdir(parents=True)
    (work / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (work / ".venv" / "bin" / "python").symlink_to(sys.executable)  # as `python -m venv` makes it
    (work / ".venv" / "bin" / "python3").symlink_to("python")
    (work / ".venv" / "lib64").symlink_to("lib")
    (work / "train.py").write_text("print('hi')\n")
    names, [warning] = shipped(work, monkeypatch)
    assert ".venv/lib64" in names and ".venv/pyvenv.cfg" in names and "train.py" in names
    assert not any(n.startswith(".venv/bin/python") for n in names)
    assert ".venv/bin/python -> " in warning and ".venv/bin/python3 -> python" in warning


def test_secrets_and_caches_stay_behind_and_the_ignore_file_says_what_else(tmp_path, monkeypatch):
    work = tmp_path / "work"
    for name in [".git/config", ".env", ".env.local", ".env.example", "deploy/key.pem", "keys/id_ed25519",
                 "pkg/__pycache__/m.cpython-311.pyc", "pkg/m.py", "data/big.bin", "model.ckpt", "notes.md",
                 "scratch/job.py"]:  # fmt: skip
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("x")
    names, warned = shipped(work, monkeypatch)
    assert names == [
        *["data", "data/big.bin", "deploy", "keys", "model.ckpt", "notes.md", "pkg", "pkg/m.py"],
        *["scratch", "scratch/job.py"],
    ]
    assert warned == []
    # gitignore syntax; a "!" takes a default back, but nothing under a folder left out (as git).
    (work / ".cmlclusterignore").write_text("data/\n*.ckpt\nscratch/\n!.env.example\n!.git/config\n")
    names, _ = shipped(work, monkeypatch, to="again")
    assert names == [".cmlclusterignore", ".env.example", "deploy", "keys", "notes.md", "pkg", "pkg/m.py"]
    with Session(remote(), echo=False) as s:  # a script named to run travels even where the rules leave it out
        shipment = s.ship(["scratch/job.py"], working_folder=True)
    assert shipment.names == {"scratch/job.py": "scratch/job.py"}
    unpack(shipment.files, str(tmp_path / "job"))
    assert (tmp_path / "job" / "scratch" / "job.py").read_text() == "x"


def test_the_size_cap_counts_what_ships_and_names_the_size_and_the_ways_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "pack").write_bytes(b"x" * 300_000)  # left out: not counted
    (tmp_path / "train.py").write_text("")
    monkeypatch.setenv("CMLCLUSTER_SHIP_LIMIT_MB", "0.2")
    with Session(remote(), echo=False) as s:
        s.ship([], working_folder=True)
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "big.bin").write_bytes(b"x" * 400_000)
        with pytest.raises(ConfigError) as refused:
            s.ship([], working_folder=True)
    message = str(refused.value)
    assert f"the working folder {tmp_path} holds more than 0.2 MB to ship: 0.4 MB, most in data (0.4 MB)" in message
    assert f"{tmp_path / '.cmlclusterignore'} (gitignore syntax)" in message and "CMLCLUSTER_SHIP_LIMIT_MB" in message


# A CML project folder is the user's HOME: the stores of the usual CLIs lie in it beside the code.
HOME_SECRETS = [
    ".aws/credentials", ".aws/config", ".azure/msal_token_cache.json", ".config/gcloud/credentials.db",
    ".config/gcloud/application_default_credentials.json", ".kube/config", ".oci/config", ".cdp/credentials",
    ".databrickscfg", ".boto", ".s3cfg", ".docker/config.json", ".config/containers/auth.json", ".vault-token",
    ".terraform.d/credentials.tfrc.json", ".netrc", ".git-credentials", ".config/git/credentials",
    ".config/gh/hosts.yml", ".pypirc", ".npmrc", ".kaggle/kaggle.json", ".cache/huggingface/token",
    ".cache/huggingface/stored_tokens", ".huggingface/token", "app/.streamlit/secrets.toml", ".pgpass", ".my.cnf",
    ".yarnrc.yml", ".pip/pip.conf", ".config/pip/pip.conf", ".condarc", ".dockercfg", ".Renviron",
    ".config/rclone/rclone.conf", ".dbt/profiles.yml", ".snowsql/config",
    ".ssh/config", ".ssh/known_hosts", ".ssh/authorized_keys", ".ssh/id_ed25519", ".ssh/id_ed25519.pub",
    ".gnupg/pubring.kbx", ".local/share/keyrings/login.keyring", ".local/share/python_keyring/keyring_pass.cfg",
    ".password-store/db.gpg", "deploy/server.pem", "deploy/server.key", "deploy/client.p12", "deploy/client.pfx",
    "deploy/putty.ppk", "deploy/app.jks", "deploy/release.keystore", "keys/id_rsa", "keys/id_rsa_github",
    "keys/id_dsa", "keys/id_ecdsa", "keys/id_ed25519_sk",
    ".local/share/jupyter/runtime/jpserver-1234.json", ".local/share/jupyter/runtime/jpserver-1234-open.html",
    ".local/share/jupyter/runtime/kernel-6c1f9c5e-1b7d-4a2f-9f1e-2d3c4b5a6978.json",
    ".local/share/jupyter/runtime/kernel-v2-1234abcd.json", "jpserver-99.json", "nbserver-98.json",
    ".ipython/profile_default/security/ipcontroller-client.json", ".ipython/profile_default/history.sqlite",
    ".jupyter/jupyter_server_config.json", ".env", ".env.local", ".envrc", ".bash_history", ".zsh_history",
    ".python_history", ".psql_history", ".mysql_history", ".sqlite_history", ".node_repl_history", ".Rhistory",
    ".scala_history_jline3", ".local/share/fish/fish_history", ".lesshst", ".viminfo",
]  # fmt: skip
# What must travel: code and data, whatever their names start with, and what merely sits beside a secret.
HOME_CODE = [
    "train.py", "src/id_utils.py", "data/id_to_label.json", "data/keys.csv", "keys/id_ed25519.pub",
    "tools/id_rsa_tool.py", "notebooks/id_ecdsa_explained.ipynb",
    "notebooks/history.ipynb", "src/key_value.py", ".ipython/profile_default/startup/00-setup.py",
    ".jupyter/lab/user-settings/theme.json", ".config/app/settings.toml", "app/.streamlit/config.toml",
    "src/environment.py", "requirements.txt",
]  # fmt: skip


def home(tmp_path, extra: tuple[str, ...] = ()):
    folder = tmp_path / "home"
    for name in [*HOME_SECRETS, *HOME_CODE, ".git/config", "src/__pycache__/id_utils.cpython-311.pyc", *extra]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("x")
    return folder


def shipped_files(folder, monkeypatch, caplog, to: str = "worker") -> tuple[list[str], list[str]]:
    """The files a worker that does not see `folder` gets of it, and the notices shipping logged."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cmlcluster.shipping"):
        names, _ = shipped(folder, monkeypatch, to)
    out = folder.parent / to
    files = [n for n in names if not (out / n).is_dir()]
    return files, [r.getMessage() for r in caplog.records if r.name == "cmlcluster.shipping"]


def test_a_home_folder_ships_its_code_and_keeps_every_credential_store_home(tmp_path, monkeypatch, caplog):
    files, _ = shipped_files(home(tmp_path), monkeypatch, caplog)
    assert sorted(set(files) & set(HOME_SECRETS)) == []
    assert files == sorted(HOME_CODE)  # code named id_* or *key*, public keys, settings beside secrets


def test_one_notice_names_what_the_defaults_kept_home_and_how_to_ship_one(tmp_path, monkeypatch, caplog):
    folder = home(tmp_path)
    _, [notice] = shipped_files(folder, monkeypatch, caplog)
    assert notice.startswith(
        "cmlcluster: not shipped to workers (may hold credentials): .Renviron, .Rhistory, .aws/, .azure/, "
        ".bash_history and "
    )  # in the order found: folders once, by their own name
    more = int(notice.split(" and ")[1].split(" more")[0])
    assert more == 68  # every other file or folder kept home, counted; nothing quiet (.git, __pycache__) is
    assert notice.endswith(
        f"; in {folder / '.cmlclusterignore'} a !pattern ships one (e.g. !.Renviron), a plain pattern keeps it "
        "home unsaid"
    )
    assert "\n" not in notice
    # What the user's own file leaves out is their choice, and not named again; with nothing kept home
    # by the defaults, nothing is said.
    quiet = tmp_path / "quiet"
    for name in [".git/config", "pkg/__pycache__/m.pyc", "pkg/m.py", "secrets/token.txt", ".netrc"]:
        (quiet / name).parent.mkdir(parents=True, exist_ok=True)
        (quiet / name).write_text("x")
    (quiet / ".cmlclusterignore").write_text("secrets/\n.netrc\n")
    files, notices = shipped_files(quiet, monkeypatch, caplog, to="quiet-worker")
    assert (files, notices) == ([".cmlclusterignore", "pkg/m.py"], [])


def test_a_negation_in_the_ignore_file_ships_a_default_and_the_notice_stops_naming_it(tmp_path, monkeypatch, caplog):
    folder = home(tmp_path, extra=(".env.example",))
    (folder / ".cmlclusterignore").write_text(
        "# ours: the workers need them\n!.env.example\n!deploy/server.key\n!.kube/\n!.ssh/known_hosts\n"
    )
    files, [notice] = shipped_files(folder, monkeypatch, caplog)
    taken_back = [".cmlclusterignore", ".env.example", ".kube/config", "deploy/server.key"]
    assert sorted(set(files) - set(HOME_CODE)) == taken_back
    assert ".ssh/known_hosts" not in files  # as in git: nothing inside a folder left out comes back...
    assert " and 66 more;" in notice  # 73 kept home before, less .kube/ and deploy/server.key; .ssh/ still
    (folder / ".cmlclusterignore").write_text("!.ssh/\n.ssh/*\n!.ssh/known_hosts\n")  # ...unless the folder does
    files, _ = shipped_files(folder, monkeypatch, caplog, to="again")
    assert sorted(set(files) - set(HOME_CODE)) == [".cmlclusterignore", ".ssh/known_hosts"]


def test_a_link_named_like_a_credential_store_stays_home_and_is_named(tmp_path, monkeypatch, caplog):
    folder = tmp_path / "home"
    (folder / "vault" / "aws").mkdir(parents=True)
    (folder / "vault" / "aws" / "notes.txt").write_text("x")
    (folder / ".aws").symlink_to("vault/aws")  # a folder's name, reached through a link
    (folder / ".netrc").symlink_to(tmp_path)
    files, [notice] = shipped_files(folder, monkeypatch, caplog)
    assert files == ["vault/aws/notes.txt"]
    assert "(may hold credentials): .aws/, .netrc/; " in notice
