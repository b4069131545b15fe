"""What an agent's engine leaves unimported as it starts (agent/engine_imports.py): each check runs in a fresh
interpreter, as an agent starts, and compares with what ipyparallel does on its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

AS_AN_AGENT = """
from cmlcluster.agent import engine_imports
engine_imports.engine_without_the_client()
import ipyparallel.engine.app
engine_imports.replies_import_only_what_is_imported()
"""

ENGINE = """
import json, sys
from ipyparallel import util  # a submodule
from ipyparallel.serialize import canning, serialize_object, deserialize_object
serialize_object([{"ip_address": "10.0.0.2", "pid": 7}])  # an engine's first reply
seen = {"after_reply": sorted(m for m in sys.modules if m.split(".")[0] == "numpy" or m.startswith(
    ("ipyparallel.cluster", "ipyparallel.client.client")))[:3]}
seen["dependent"] = any(getattr(k, "__name__", "") == "dependent" for k in canning.can_map)
import numpy  # the program's, say
array = numpy.arange(6.0)
seen["array"] = type(canning.can(array)).__name__
seen["round_trip"] = deserialize_object(serialize_object(array))[0].tolist()
import ipyparallel
seen["client"] = ipyparallel.Client.__module__  # a name of the package: its __init__ runs now
seen["after_client"] = "ipyparallel.cluster" in sys.modules
seen["interactive"] = ipyparallel.interactive is util.interactive
seen["one_map"] = ipyparallel.serialize.can_map is canning.can_map
print(json.dumps(seen))
"""


def run(code: str) -> dict:
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def test_an_engine_imports_neither_the_client_nor_numpy_and_user_code_still_gets_both():
    assert run(AS_AN_AGENT + ENGINE) == {
        "after_reply": [],
        "dependent": True,
        "array": "CannedArray",  # as ipyparallel sends an array once numpy is imported
        "round_trip": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
        "client": "ipyparallel.client.client",
        "after_client": True,
        "interactive": True,
        "one_map": True,
    }


def test_ipyparallel_on_its_own_imports_both_at_the_first_reply():
    seen = run("import ipyparallel.engine.app\n" + ENGINE)
    assert seen["after_reply"] == ["ipyparallel.client.client", "ipyparallel.cluster", "ipyparallel.cluster._winhpcjob"]
    assert seen["array"] == "CannedArray"


@pytest.mark.parametrize("step", ["engine_without_the_client", "replies_import_only_what_is_imported"])
def test_each_step_leaves_an_imported_ipyparallel_as_it_is(step):
    code = f"""
import ipyparallel, json, sys
from ipyparallel.serialize import canning
from cmlcluster.agent import engine_imports
engine_imports.{step}()
engine_imports.{step}()  # twice: the second finds it done
print(json.dumps({{"same": sys.modules["ipyparallel"] is ipyparallel, "map": type(canning.can_map).__name__}}))
"""
    expected_map = "dict" if step == "engine_without_the_client" else "TypesOfImportedModules"
    assert run(code) == {"same": True, "map": expected_map}
