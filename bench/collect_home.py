"""What bringing collect= files home costs (cmlcluster/collect/home.py): the session's guarded
extraction (only under the collect= paths, each folder opened without following links, never over a file
that was there) against tarfile's own extraction with its "data" filter, of the same stream.

Alternates the two in this one process, each into a fresh folder, and prints each one's median and their
ratio (guarded / tarfile; lower is better).

    python bench/collect_home.py [--files 2000] [--size 4096] [--repeat 7]
"""

from __future__ import annotations

import argparse
import io
import statistics
import tarfile
import tempfile
import time

from cmlcluster.collect.home import Arrival, Homecoming


def stream(files: int, size: int) -> bytes:
    """A tar of `files` files of `size` bytes, 50 to a folder, under outputs/."""
    out = io.BytesIO()
    data = b"x" * size
    with tarfile.open(fileobj=out, mode="w") as tar:
        for i in range(files):
            info = tarfile.TarInfo(f"outputs/part-{i // 50}/file-{i}.bin")
            info.size, info.mode, info.mtime = size, 0o644, time.time()
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def guarded(data: bytes, folder: str) -> None:
    arrival = Arrival("bench-1", folder, ("outputs",))
    Homecoming().unpack([data[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20)], arrival)
    assert arrival.files > 0 and not arrival.behind, arrival


def plain(data: bytes, folder: str) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
        tar.extractall(folder, filter="data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    data = stream(args.files, args.size)
    times: dict[str, list[float]] = {"guarded": [], "tarfile": []}
    for _ in range(args.repeat):
        for name, extract in (("guarded", guarded), ("tarfile", plain)):
            with tempfile.TemporaryDirectory() as folder:
                t0 = time.perf_counter()
                extract(data, folder)
                times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name:8s} median {median * 1000:8.1f} ms for {args.files} files of {args.size} bytes")
    print(f"ratio guarded/tarfile: {medians['guarded'] / medians['tarfile']:.2f}")


if __name__ == "__main__":
    main()
