"""Plain config trees with a few keys changed, for tests that probe one term or rule at a time."""
import copy
from typing import Any, Dict


def updated(tree: Dict[str, Any], **updates: Any) -> Dict[str, Any]:
    """A deep copy of the plain `tree` with dotted updates (`a__b=1` sets `a.b`)."""
    t = copy.deepcopy(tree)
    for dotted, value in updates.items():
        *parents, leaf = dotted.split("__")
        node = t
        for p in parents:
            node = node[p]
        node[leaf] = value
    return t
