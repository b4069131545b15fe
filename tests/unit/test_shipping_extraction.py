"""Unpacking in a worker: crafted archives write nothing outside the folder and are refused whole.

Every test runs as on Pythons without tarfile's "data" filter (before 3.11.4, as Debian 12's 3.11.2)
and with it: unpack's checks are its own on both.
"""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from cmlcluster.shipping import UnsafeArchive, unpack


@pytest.fixture(params=["data filter", "no data filter"], autouse=True)
def python(request, monkeypatch):
    if request.param == "no data filter":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)


def archive(*members: tuple) -> bytes:
    """A tar.gz of (name, type, linkname) members; regular files hold b"x"."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, kind, link in members:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, link
            if kind == tarfile.REGTYPE:
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
            else:
                tar.addfile(info)
    return buffer.getvalue()


FILE, DIR, LINK, HARD = tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE
GOOD = ("good.py", FILE, "")  # first in every crafted archive: refused with the rest, never written


def refused(tmp_path, data: bytes, match: str) -> None:
    """Unpacking into tmp_path/dest is refused before anything is written, inside or out."""
    (tmp_path / "bystander.txt").write_text("untouched")
    dest = tmp_path / "dest"
    with pytest.raises(UnsafeArchive, match=match):
        unpack(data, str(dest))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bystander.txt", "dest"]
    assert (tmp_path / "bystander.txt").read_text() == "untouched"
    assert list(dest.iterdir()) == []


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ([("/tmp/escape.py", FILE, "")], "'/tmp/escape.py' has an absolute name"),
        ([("../escape.py", FILE, "")], r"'\.\./escape.py' has '\.\.' in its name"),
        ([("sub/../../escape.py", FILE, "")], "has '..' in its name"),
        ([("dev", tarfile.CHRTYPE, "")], "'dev' is a device, a fifo or another special file"),
        ([("disk", tarfile.BLKTYPE, "")], "'disk' is a device"),
        ([("fifo", tarfile.FIFOTYPE, "")], "'fifo' is a device, a fifo"),
        ([("h", HARD, "good.py")], r"'h' is a hard link \(to 'good.py'\)"),
        ([("h", HARD, "/etc/passwd")], "'h' is a hard link"),
        ([(".", LINK, "/")], "is a link to '/', which leaves the folder"),
    ],
    ids=[
        "absolute",
        "dotdot",
        "dotdot-inside",
        "char-device",
        "block-device",
        "fifo",
        "hard-inside",
        "hard-out",
        "root",
    ],
)
def test_crafted_members_are_refused_whole_with_a_clear_error(tmp_path, members, match):
    refused(tmp_path, archive(GOOD, *members), match=rf"refused the files shipped to .*{match}.*nothing was unpacked")


def test_a_link_chain_cannot_carry_a_file_out_of_the_folder(tmp_path):
    # The fallback of old checked each name before anything existed: a -> ., then a/b (really b) -> ..,
    # then a/b/f was really ../f, outside the folder.
    chain = archive(GOOD, ("a", LINK, "."), ("a/b", LINK, ".."), ("a/b/f", FILE, ""))
    refused(tmp_path, chain, match="'a/b' lies under 'a', a link of the same archive; nothing was unpacked")


@pytest.mark.parametrize(
    "link",
    ["/etc/passwd", "../outside", "sub/../../outside", "x/x/..", ""],
    ids=["absolute", "up", "up-inside-a-name", "dotdot-after-a-link", "empty"],
)
def test_links_that_leave_the_folder_are_refused(tmp_path, link):
    # "x/x/.." reads as "x", inside; but with x -> ".", x/x is the folder itself and ".." its parent.
    members = [GOOD, ("x", LINK, "."), ("l", LINK, link)]
    refused(tmp_path, archive(*members), match=f"'l' is a link to {link!r}, which leaves the folder")


def test_links_inside_the_folder_are_made_last_and_work(tmp_path):
    data = archive(
        ("latest", LINK, "runs/1"),  # before its target in the archive: links come last
        ("runs/1/model.bin", FILE, ""),
        ("runs/1/same", LINK, "model.bin"),
        ("runs/1/top", LINK, "../../latest"),
        ("here", LINK, "."),
    )
    dest = tmp_path / "dest"
    unpack(data, str(dest))
    assert os.readlink(dest / "latest") == "runs/1" and (dest / "latest" / "model.bin").read_bytes() == b"x"
    assert (dest / "runs/1/same").read_bytes() == b"x" and (dest / "runs/1/top/same").read_bytes() == b"x"
    assert (dest / "here").resolve() == dest.resolve()


def test_a_link_already_in_the_folder_is_replaced_never_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "conf").write_text("theirs")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "conf").symlink_to(outside / "conf")  # left by anything: the worker's folder is not ours alone
    (dest / "data").symlink_to(outside)
    unpack(archive(("conf", FILE, "")), str(dest))
    assert (outside / "conf").read_text() == "theirs"
    assert not (dest / "conf").is_symlink() and (dest / "conf").read_bytes() == b"x"
    with pytest.raises(UnsafeArchive, match="where 'data' is a link or a file, not a folder"):
        unpack(archive(("data/f", FILE, "")), str(dest))
    assert sorted(p.name for p in outside.iterdir()) == ["conf"]


def test_modes_lose_set_id_bits_and_write_by_others(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("run.sh")
        info.size, info.mode = 1, 0o4777
        tar.addfile(info, io.BytesIO(b"x"))
    unpack(buffer.getvalue(), str(tmp_path))
    assert (tmp_path / "run.sh").stat().st_mode & 0o7777 == 0o755
