"""A node's lifecycle: the table in `kvtier.cache.states`'s docstring is the one in code, every other
transition is refused before anything changes, and nothing else in the cache writes a node's state."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

from kvtier.cache import states
from kvtier.cache.radix import Node, RadixTree
from kvtier.cache.states import INITIAL, TABLE, Event, NodeState, TransitionError, transition
from kvtier.errors import InvariantError, KVTierError


def docstring_table() -> dict[tuple[Event, NodeState], NodeState]:
    """The rows `event  from  to` under the docstring's `event  from  to` header."""
    lines = states.__doc__.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split() == ["event", "from", "to"])
    rows = {}
    for line in lines[at + 1 :]:
        if not line.strip():
            break
        event, start, end = line.split()
        key = (Event(event), NodeState(start))
        assert key not in rows, f"row {line.strip()!r} twice"
        rows[key] = NodeState(end)
    return rows


def test_the_docstrings_table_is_the_codes() -> None:
    rows = docstring_table()
    assert len(rows) >= 30
    assert rows == TABLE


def test_every_state_is_reached_and_every_one_leads_to_dropped() -> None:
    reached = set(INITIAL)
    for _ in range(len(NodeState)):
        reached |= {to for (_, start), to in TABLE.items() if start in reached}
    assert reached == set(NodeState)
    # From every state the node can leave the tree (nothing is stuck).
    leaves = {NodeState.DROPPED}
    for _ in range(len(NodeState)):
        leaves |= {start for (_, start), to in TABLE.items() if to in leaves}
    assert leaves == set(NodeState)


def test_state_properties_agree_with_the_names() -> None:
    for s in NodeState:
        assert s.on_device == (s.value.split("_")[0] in ("device", "backing", "both", "loading"))
        assert s.stored == s.value.endswith("_stored")
        assert s.storing == (s.value.endswith("_storing") or s is NodeState.HOST_WRITING_BACK)
        assert not (s.stored and s.storing)
        if s.storing:
            assert s.on_host and s not in (NodeState.BACKING_UP, NodeState.FETCHING)  # a readable copy


@pytest.mark.parametrize("state", list(NodeState))
def test_a_transition_not_in_the_table_is_refused_and_changes_nothing(state: NodeState) -> None:
    node = Node(key=np.arange(2), parent=None, state=state)
    for event in Event:
        if (event, state) in TABLE:
            continue
        with pytest.raises(TransitionError, match=f"no transition {event.value} from {state.value}"):
            transition(node, event)
        assert node.state is state
    assert issubclass(TransitionError, KVTierError)


def test_allowed_transitions_move_the_node() -> None:
    node = Node(key=np.arange(2), parent=None)
    path = [Event.BACK_UP, Event.BACKED_UP, Event.STORE, Event.EVICT_DEVICE, Event.LOAD, Event.STORED]
    seen = [transition(node, e) for e in path]
    assert seen == [
        NodeState.BACKING_UP,
        NodeState.BOTH,
        NodeState.BOTH_STORING,
        NodeState.HOST_STORING,
        NodeState.LOADING_STORING,
        NodeState.LOADING_STORED,
    ]


def test_the_tree_drops_only_what_may_be_dropped_and_starts_nodes_in_initial_states() -> None:
    tree = RadixTree(2)
    loading = tree.add_child(tree.root, np.array([1, 1]), None)
    transition(loading, Event.BACK_UP)  # backing_up: its host copy is being written
    with pytest.raises(TransitionError):
        tree.remove(loading)
    assert loading.state is NodeState.BACKING_UP and tree.root.children  # still in the tree
    with pytest.raises(InvariantError, match="a new node starts in one of"):
        tree.add_child(tree.root, np.array([2, 2]), None, state=NodeState.HOST)


def test_nothing_in_the_cache_assigns_a_nodes_state_but_the_transition() -> None:
    root = Path(states.__file__).parent
    offenders = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets += [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and sub.attr == "state":
                        offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == ["states.py:" + str(_assignment_line())]


def _assignment_line() -> int:
    src = Path(states.__file__).read_text().splitlines()
    return next(i + 1 for i, line in enumerate(src) if re.match(r"\s+node\.state = to$", line))
