"""The router's own view of the nodes (router.view): what the daemon lists, as the router's
probes find the engines. Pure, no I/O."""

from __future__ import annotations

import pytest

from router.choice import Node
from router.view import Listed, NodeView


def node(engine: str, url: str = "") -> Node:
    role = "prefill" if engine.startswith("p") else "decode"
    return Node(engine_id=engine, role=role, url=url or f"http://{engine}")


def listed(engine: str, alive: bool = True, generation: int = 1, url: str = "") -> Listed:
    return Listed(node(engine, url), alive, generation)


def ids(view: NodeView) -> list[str]:
    return [n.engine_id for n in view.nodes]


def test_nodes_listed_alive_are_routed_to_and_unlisted_ones_dropped() -> None:
    view = NodeView(failures=2)
    view.listed([listed("p1"), listed("d1"), listed("d2")])
    assert ids(view) == ["d1", "d2", "p1"]
    view.listed([listed("p1"), listed("d1")])  # d2 deregistered (or collected): believed
    assert ids(view) == ["d1", "p1"]


def test_a_lapsed_node_is_kept_only_if_this_router_knew_it_alive() -> None:
    view = NodeView()
    view.listed([listed("p1"), listed("d1")])
    view.listed([listed("p1", alive=False), listed("d1", alive=False), listed("d9", alive=False)])
    assert ids(view) == ["d1", "p1"]  # (d9: never seen alive, nothing vouches for it)
    assert view.lapsed == ["d1", "p1"]
    view.listed([listed("p1"), listed("d1")])
    assert view.lapsed == []


def test_a_node_failing_its_probes_is_left_out_whatever_the_daemon_says_and_back_when_it_answers() -> None:
    view = NodeView(failures=2)
    view.listed([listed("p1"), listed("d1")])
    assert view.probed("d1", "http://d1", False) is False  # one failure: still in
    assert view.probed("d1", "http://d1", False) is True
    assert ids(view) == ["p1"] and view.failing == ["d1"]
    view.listed([listed("p1"), listed("d1")])  # the daemon still lists it alive: still out
    assert ids(view) == ["p1"]
    assert [n.engine_id for n in view.probed_nodes] == ["p1", "d1"]  # (still probed)
    assert view.probed("d1", "http://d1", True) is True
    assert ids(view) == ["d1", "p1"] and view.failing == []


def test_a_lapsed_node_failing_its_probes_is_left_out() -> None:
    view = NodeView(failures=1)
    view.listed([listed("d1")])
    view.listed([listed("d1", alive=False)])
    view.probed("d1", "http://d1", False)
    assert ids(view) == [] and view.lapsed == [] and view.failing == ["d1"]


def test_a_restarted_or_moved_engine_starts_its_probes_over() -> None:
    view = NodeView(failures=1)
    view.listed([listed("d1")])
    view.probed("d1", "http://d1", False)
    assert ids(view) == []
    view.listed([listed("d1", generation=2)])  # a new process, registered by its sidecar
    assert ids(view) == ["d1"]
    view.probed("d1", "http://d1", False)
    view.listed([listed("d1", generation=2, url="http://elsewhere")])
    assert ids(view) == ["d1"]
    # A probe sent to the old address counts for nothing.
    assert view.probed("d1", "http://d1", False) is False and ids(view) == ["d1"]
    assert view.probed("gone", "http://gone", False) is False


def test_a_lapsed_node_whose_address_a_live_node_has_now_is_dropped() -> None:
    view = NodeView()
    view.listed([listed("d1", url="http://10.0.0.5")])
    view.listed([listed("d1", alive=False, url="http://10.0.0.5"), listed("d2", url="http://10.0.0.5")])
    assert ids(view) == ["d2"]


def test_failures_must_be_positive() -> None:
    with pytest.raises(ValueError):
        NodeView(failures=0)
