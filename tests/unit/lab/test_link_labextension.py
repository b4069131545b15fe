"""scripts/link_labextension.py: what it writes into an environment for an editable install, and --remove,
which takes back exactly that (pip knows of neither file)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))

import link_labextension  # noqa: E402


def files_under(prefix: pathlib.Path) -> set[str]:
    return {p.relative_to(prefix).as_posix() for p in prefix.rglob("*") if p.is_file() or p.is_symlink()}


def test_remove_takes_back_exactly_what_link_wrote(tmp_path, capsys):
    prefix = tmp_path / "env"
    mine = prefix / "share" / "jupyter" / "labextensions" / "someone-elses"
    mine.mkdir(parents=True)
    (mine / "package.json").write_text("{}")
    before = files_under(prefix)
    link_labextension.link(prefix)
    [(link, bundle)], switch = link_labextension.written(prefix)
    assert link.is_symlink() and link.resolve() == bundle.resolve() and switch.is_file()
    link_labextension.remove(prefix)
    assert files_under(prefix) == before  # the rest of the environment as it was
    assert link.parent.is_dir() and switch.parent.is_dir()  # folders other things may share stay


def test_remove_leaves_what_it_did_not_write(tmp_path, capsys):
    prefix = tmp_path / "env"
    [(link, _)], switch = link_labextension.written(prefix)
    link.mkdir(parents=True)  # a wheel's copy of the bundle
    (link / "package.json").write_text("{}")
    switch.parent.mkdir(parents=True)
    switch.write_text('{"ServerApp": {"jpserver_extensions": {"cmlcluster.lab": false}}}')  # edited since
    link_labextension.remove(prefix)
    assert (link / "package.json").is_file() and "false" in switch.read_text()
    out = capsys.readouterr().out
    assert f"{link}: left alone" in out and f"{switch}: left alone" in out


def test_a_wrong_argument_is_refused_naming_it():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "link_labextension.py"), "--uninstall"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "'--uninstall': give no argument, or --remove" in done.stderr
