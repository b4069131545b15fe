"""An elastic run's signed rendezvous backend against a real TCPStore: torch's compare-and-set, no stranger's
bytes ever unpickled, and never a state older than one some node already acted on after a stranger's write."""

from __future__ import annotations

import os
import pickle
from base64 import b64encode
from datetime import datetime, timedelta, timezone

import pytest

from cmlcluster.pytorch import rendezvous

KEY = bytes(range(32))
NAME = "torch.rendezvous.run"


class Unpickled:
    """What a stranger writes under the rendezvous key: unpickling it records that it ran."""

    ran: list[str] = []

    def __reduce__(self):
        return (Unpickled.ran.append, ("ran",))


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    yield TCPStore("127.0.0.1", server.port, is_master=False)


def state(*nodes: str, complete: bool = False, beat: float = 0) -> bytes:
    """torch's own rendezvous state with `nodes` taking part, each last heard `beat` seconds after a fixed time."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    held = _RendezvousState()
    held.complete = complete
    held.participants = {_NodeDesc(node, 1, 0): rank for rank, node in enumerate(nodes)}
    at = datetime(2026, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=beat)
    held.last_heartbeats = {_NodeDesc(node, 1, 0): at for node in nodes}
    return pickle.dumps(held)


def epochs(store) -> int:
    """How many membership epochs the store holds."""
    count = 0
    while store.check([f"{NAME}/membership/{count + 1}"]):
        count += 1
    return count


def test_the_state_is_signed_and_set_by_compare_and_set_as_torchs():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    value = rendezvous.sign(KEY, NAME, 3, b"state")
    assert rendezvous.verified(KEY, NAME, value) == (3, b"state")
    assert rendezvous.verified(bytes(32), NAME, value) is None  # another key
    assert rendezvous.verified(KEY, "torch.rendezvous.other", value) is None  # another run
    assert rendezvous.verified(KEY, NAME, b"\xff") is None

    class Store:
        def compare_set(self, *args):
            return rendezvous.NULL_STATE

    assert isinstance(rendezvous.signed_backend(Store(), "run", KEY), RendezvousBackend)


def test_heartbeats_share_an_epoch_and_each_change_of_membership_claims_one(store):
    ours, theirs = rendezvous.signed_backend(store, "run", KEY), rendezvous.signed_backend(store, "run", KEY)
    assert ours.get_state() is None  # torch's "no state yet"
    got, token, has_set = ours.set_state(state("a"))
    assert (got, has_set) == (state("a"), True) and theirs.get_state() == (state("a"), token)
    assert ours.set_state(state("a", "b"), b"stale token")[1:] == (token, False)  # compare-and-set, as torch's
    for beat in range(1, 4):  # heartbeats: no new epoch, so the store does not grow with a run's length
        got, token, has_set = ours.set_state(state("a", beat=beat), token)
        assert has_set
    assert epochs(store) == 1
    # A change made from a state that is no longer the newest fails, as torch's, whatever it changes.
    assert theirs.set_state(state("a", "b"), theirs.get_state()[1])[2]
    assert ours.set_state(state("a", "c"), token)[:2] == (state("a", "b"), store.get(NAME))
    assert epochs(store) == 2


def test_a_strangers_value_is_never_unpickled_and_the_newest_state_is_put_back(store, caplog):
    ours, theirs = rendezvous.signed_backend(store, "run", KEY), rendezvous.signed_backend(store, "run", KEY)
    _, token, _ = ours.set_state(state("a", "b", complete=True))
    assert theirs.get_state() == (state("a", "b", complete=True), token)
    payload = b64encode(pickle.dumps(Unpickled()))  # torch's own backend b64-decodes and unpickles this
    other_key = rendezvous.sign(bytes(32), NAME, 1, pickle.dumps(Unpickled()))
    for forged in (payload, other_key, b"\xff", rendezvous.NULL_STATE):
        store.set(NAME, forged)
        with caplog.at_level("WARNING"):
            assert theirs.get_state() == (state("a", "b", complete=True), token)
        assert store.get(NAME) == token
    assert "did not sign" in caplog.text and Unpickled.ran == []
    assert caplog.text.count("did not sign") == 3  # "no state yet" is no one's forgery: only what it hides is


def test_after_a_strangers_write_no_node_goes_back_past_a_join_another_node_acted_on(store):
    """What failed once in CI: a node put back its own last state, from before the other node completed
    the round; the other node had its rank already, and both waited for each other's rank info for 60 s."""
    first, second = rendezvous.signed_backend(store, "run", KEY), rendezvous.signed_backend(store, "run", KEY)
    _, first_token, _ = first.set_state(state("a"))  # `first` joins and waits
    assert second.get_state() == (state("a"), first_token)
    _, completed, has_set = second.set_state(state("a", "b", complete=True), first_token)  # the round completes
    assert has_set
    store.set(NAME, b64encode(pickle.dumps(Unpickled())))  # before `first` has read it
    # `first` reads the completed round from its epoch, not its own older state, and does not put back a
    # copy whose heartbeats may be old: the node that holds them does.
    assert first.get_state() == (state("a", "b", complete=True), completed)
    assert store.get(NAME) != completed
    assert second.get_state() == (state("a", "b", complete=True), completed)
    assert store.get(NAME) == completed
    assert first.set_state(state("a", "b", complete=True, beat=1), completed)[2]  # its heartbeat lands
    assert Unpickled.ran == []


def test_a_node_that_starts_while_a_strangers_value_is_there_finds_the_newest_membership(store):
    old = rendezvous.signed_backend(store, "run", KEY)
    token = old.set_state(state("a"))[1]
    token = old.set_state(state("a", "b", complete=True), token)[1]
    store.set(NAME, b"forged")
    fresh = rendezvous.signed_backend(store, "run", KEY)  # a replacement node: no state of its own yet
    assert fresh.get_state() == (state("a", "b", complete=True), token)  # not "no state yet"
    # Nor can it make a change from there until a node with current heartbeats has put the state back.
    assert fresh.set_state(state("a", "b", "c"), token)[2] is False
    assert epochs(store) == 2
    old.get_state()
    assert fresh.set_state(state("a", "b", "c"), token)[2] is True


def test_an_old_signed_state_written_back_by_a_stranger_is_replaced_by_the_newest(store):
    ours = rendezvous.signed_backend(store, "run", KEY)
    old = ours.set_state(state("a"))[1]
    newest = ours.set_state(state("a", "b", complete=True), old)[1]
    store.set(NAME, old)  # signed, but an earlier epoch
    assert ours.get_state() == (state("a", "b", complete=True), newest)
    assert store.get(NAME) == newest


def test_a_strangers_value_in_the_next_epoch_stops_the_rendezvous_without_being_read(store):
    from torch.distributed.elastic.rendezvous import RendezvousStateError

    ours = rendezvous.signed_backend(store, "run", KEY)
    ours.set_state(state("a"))
    store.set(f"{NAME}/membership/2", b64encode(pickle.dumps(Unpickled())))
    with pytest.raises(RendezvousStateError, match="epoch 2 holds a value this run did not sign"):
        ours.get_state()
    assert Unpickled.ran == []


def test_a_stranger_who_keeps_overwriting_the_state_fails_the_sync_without_it_being_read(store):
    from torch.distributed.elastic.rendezvous import RendezvousStateError

    ours = rendezvous.signed_backend(store, "run", KEY)
    ours.set_state(state("a"))

    class Contested:  # a stranger writes the key anew just before each of the node's compare-and-sets
        get, check = store.get, store.check
        writes = 0

        def compare_set(self, name, expected, desired):
            self.writes += 1
            store.set(name, f"forged {self.writes}")
            return store.compare_set(name, expected, desired)

    node = rendezvous.signed_backend(Contested(), "run", KEY)
    node._known = ours._known  # it has read the newest state, so it is the one to put it back
    with pytest.raises(RendezvousStateError, match="overwritten 5 times"):
        node.get_state()


def test_launch_takes_the_key_out_of_the_environment_that_the_ranks_inherit(monkeypatch):
    monkeypatch.setenv(rendezvous.KEY_ENV, "ab" * 32)
    assert rendezvous.take_key() == bytes([0xAB] * 32)
    assert rendezvous.KEY_ENV not in os.environ and rendezvous.take_key() is None
