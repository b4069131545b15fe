"""What cmlcluster-cml.pth adds to every interpreter start (setup.py ships it: `import cml` with no
cmlcluster imported, as on CML's runtimes).

Two fresh venvs of this Python (no pip), alike but for the .pth and its module (_cmlcluster_cml.py,
a copy of cmlcluster/cml_shim/startup.py, compiled) in one; `python -c pass` alternately in each, and each's
median and their ratio (with / without; 1.00 is free). Then python -X importtime's own line for
_cmlcluster_cml.

    python bench/cml_startup.py [--runs 200]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

STARTUP = pathlib.Path(__file__).resolve().parent.parent / "cmlcluster" / "cml_shim" / "startup.py"


def venv(folder: pathlib.Path, with_pth: bool) -> str:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = str(folder / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if with_pth:
        pathlib.Path(purelib, "_cmlcluster_cml.py").write_text(STARTUP.read_text())
        pathlib.Path(purelib, "cmlcluster-cml.pth").write_text("import _cmlcluster_cml\n")
        # Compiled, as pip compiles what it installs (PYTHONDONTWRITEBYTECODE would compile it at each start).
        subprocess.run([python, "-m", "py_compile", str(pathlib.Path(purelib, "_cmlcluster_cml.py"))], check=True)
    return python


def start(python: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([python, "-c", "pass"], check=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        pythons = {
            "without": venv(pathlib.Path(folder, "without"), False),
            "with": venv(pathlib.Path(folder, "with"), True),
        }
        times: dict[str, list[float]] = {name: [] for name in pythons}
        for _ in range(args.runs):
            for name, python in pythons.items():
                times[name].append(start(python))
        medians = {name: statistics.median(t) for name, t in times.items()}
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        trace = subprocess.run(
            [pythons["with"], "-X", "importtime", "-c", "pass"], capture_output=True, text=True, env=env, check=True
        ).stderr
    line = next(line for line in trace.splitlines() if line.rstrip().endswith("_cmlcluster_cml"))
    print(f"python {sysconfig.get_python_version()}, `python -c pass`, {args.runs} runs each, alternated:")
    for name, median in medians.items():
        print(f"  {name + ' the .pth':18} median {median * 1000:7.2f} ms")
    print(f"  ratio with / without: {medians['with'] / medians['without']:.3f}")
    print(f"  -X importtime: {line.strip()}  (self us | cumulative us | module)")


if __name__ == "__main__":
    main()
