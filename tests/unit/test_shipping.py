"""What travels to workers that do not see the session's files, and what is refused."""

from __future__ import annotations

import io
import tarfile

import pytest

from cmlcluster import Session
from cmlcluster.backends import Capabilities
from cmlcluster.backends.fake import FakeBackend
from cmlcluster.errors import ConfigError
from cmlcluster.shipping import _inside, pack, unpack


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


@pytest.mark.parametrize("python_has_the_data_filter", [True, False])
def test_nothing_unpacks_outside_the_workers_folder(tmp_path, monkeypatch, python_has_the_data_filter):
    if not python_has_the_data_filter:  # Python before 3.11.4 (Debian 12's 3.11.2): our own checks
        monkeypatch.delattr(tarfile, "data_filter", raising=False)

    def archive(name: str, link: str = "") -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            info = tarfile.TarInfo(name)
            if link:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            else:
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
        return buffer.getvalue()

    with pytest.raises(tarfile.TarError):
        unpack(archive("../escape.py"), str(tmp_path / "worker"))
    assert not (tmp_path / "escape.py").exists()
    with pytest.raises(tarfile.TarError):
        unpack(archive("link", link="/etc/passwd"), str(tmp_path / "worker"))
    unpack(archive(f"{tmp_path}/absolute.py"), str(tmp_path / "worker"))  # made relative to the folder
    assert not (tmp_path / "absolute.py").exists()
    assert (tmp_path / "worker" / tmp_path.relative_to("/") / "absolute.py").exists()


def test_the_root_folder_holds_what_is_shipped_to_it(monkeypatch):
    # A worker whose working folder is "/" (an image's default): "x.py" lands inside "/". The check
    # for Pythons without the data filter took every name as outside it ("//" prefix).
    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("x.py")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with tarfile.open(fileobj=io.BytesIO(buffer.getvalue()), mode="r:gz") as tar:
        assert [m.name for m in _inside(tar, "/")] == ["x.py"]


def test_pack_keeps_names_and_contents(tmp_path):
    (tmp_path / "a.py").write_text("A")
    out = tmp_path / "out"
    unpack(pack({"b.py": str(tmp_path / "a.py")}), str(out))
    assert (out / "b.py").read_text() == "A"
