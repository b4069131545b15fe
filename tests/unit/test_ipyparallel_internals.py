"""ipyparallel's and ipykernel's names that cmlcluster reads beyond their API (ipyparallel_internals.py),
probed on the versions installed here, and the error a version without one of them gives."""

from __future__ import annotations

import pytest

from cmlcluster import ipyparallel_internals
from cmlcluster.errors import ControllerError


@pytest.fixture(autouse=True)
def unprobed(monkeypatch):
    monkeypatch.setattr(ipyparallel_internals, "_probed", set())


def test_every_name_is_where_cmlcluster_reads_it_on_this_ipyparallel():
    ipyparallel_internals.probe_client()
    ipyparallel_internals.probe_engine()
    assert ipyparallel_internals._probed == {"client", "engine"}


def test_a_renamed_name_is_an_error_naming_the_version_and_the_name(monkeypatch):
    import ipyparallel
    from ipyparallel.engine.app import IPEngine

    monkeypatch.delattr(IPEngine, "restore_output")
    with pytest.raises(ControllerError) as caught:
        ipyparallel_internals.probe_engine()
    message = str(caught.value)
    assert f"ipyparallel {ipyparallel.__version__}" in message and "IPEngine.restore_output" in message
    assert "_signal_stop" not in message  # only what is missing is named
    ipyparallel_internals.probe_client()  # the client's side has all it needs
