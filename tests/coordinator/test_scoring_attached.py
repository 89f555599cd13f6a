"""A node attached to an engine (its KV connector): the node's copies are the engine's own."""

from __future__ import annotations

from kvatlas.coordinator.scoring import (
    DEFAULT_FRAGMENT_WEIGHT,
    GPU,
    L1,
    L2,
    PEER,
    Access,
    Weights,
)
from kvatlas.directory.records import Placement

W = Weights.of(None, DEFAULT_FRAGMENT_WEIGHT)


def _at(instance_id: str, tier: str) -> Placement:
    return Placement(instance_id, 1, tier, "dram", 100, False, 0.0)


def test_a_nodes_l1_and_l2_are_its_engines_own_copies() -> None:
    attached = {"node-a": "pod-a"}
    l1 = Access.of([[_at("node-a", "l1")]], None, W, attached)
    assert l1.class_for("pod-a") == L1
    assert l1.class_for("node-a") == L1  # the node itself still holds it
    assert l1.class_for("pod-b") is None
    l2 = Access.of([[_at("node-a", "l2")]], None, W, attached)
    assert l2.class_for("pod-a") == L2


def test_the_engines_best_class_wins_over_its_nodes() -> None:
    both = Access.of([[_at("node-a", "l1"), _at("pod-a", "gpu")]], None, W, {"node-a": "pod-a"})
    assert both.class_for("pod-a") == GPU


def test_without_the_attachment_the_engine_sees_no_node_copy() -> None:
    """Negative control: the same placements, no attachment."""
    alone = Access.of([[_at("node-a", "l1")]], None, W)
    assert alone.class_for("pod-a") is None


def test_an_engines_own_node_is_not_its_peer() -> None:
    """For fragments, another instance's L1 is a peer copy; the engine's own node's L1 is
    its own (l1), not a peer fetch; another engine sees it as a peer."""
    peers = frozenset({"node-a", "node-b"})
    access = Access.of([[_at("node-a", "l1")]], peers, W, {"node-a": "pod-a", "node-b": "pod-b"})
    assert access.class_for("pod-a") == L1
    assert access.class_for("pod-b") == PEER
