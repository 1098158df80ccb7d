"""Pipeline stages of any ``nn.Module`` at split points the user names: ``--pp-split layer3``.

The names are top-level children of the module, in their order; stage 0 runs the forward up to the first named
child, stage ``k`` from the ``k``-th named child up to the next. The forward is traced with torch.fx, every
top-level child a leaf, and must be a plain sequence: one input, and every step (a child, or an operation
between children such as ``torch.flatten``) taking the previous step's output and nothing else computed
before it, each child called once, in the order the children were registered. So exactly one tensor crosses
every split point, as ``torch.distributed.pipelining`` sends it. Anything else is one line saying what to do.

A stage is an ``fx.GraphModule`` over the same root: its parameters keep the whole module's names
(``layer3.0.conv1.weight``), so checkpoints and the model dir need no renaming.
"""

from __future__ import annotations

import torch
from torch import fx

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

FIX = ("make the model's forward call its top-level children one after another (e.g. an nn.Sequential of the "
       "parts), or train it without --pp-split")


def _names(names: list[str]) -> str:
    text = ", ".join(names)
    return text if len(text) <= 200 else text[:200] + "..."


class _ChildrenAsLeaves(fx.Tracer):
    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return "." not in qualname or super().is_leaf_module(m, qualname)


def parse_split(text: str | None) -> list[str]:
    """``"layer2,layer3"`` -> ``["layer2", "layer3"]`` (empty for None)."""
    if text is None:
        return []
    names = [n.strip() for n in text.split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise PrunusError(f"--pp-split {short(text)}: give distinct child names joined by commas, e.g. layer3")
    return names


def check_split_names(module: torch.nn.Module, names: list[str]) -> list[str]:
    """One line unless every name is a top-level child of ``module``, given in the children's order."""
    children = [n for n, _ in module.named_children()]
    for name in names:
        if name not in children:
            raise PrunusError(f"--pp-split {short(name)}: not a top-level child of {type(module).__name__}; its "
                              f"children are {_names(children)}")
    order = [children.index(n) for n in names]
    if order != sorted(order) or order[0] == 0:
        raise PrunusError(f"--pp-split {','.join(names)}: name children after the first ({children[0]}), in the "
                          f"order they were registered: {_names(children)}")
    return children


def _trace(module: torch.nn.Module) -> fx.Graph:
    try:
        return _ChildrenAsLeaves().trace(module)
    except Exception as e:  # noqa: BLE001 - data-dependent control flow and the like: one line
        raise PrunusError(f"--pp-split: {type(module).__name__}'s forward cannot be traced as a sequence of its "
                          f"children ({type(e).__name__}: {short(str(e), 100)}); {FIX}") from None


def _check_chain(module: torch.nn.Module, graph: fx.Graph) -> list[fx.Node]:
    """The forward's steps (placeholder and output dropped), checked to be a plain sequence."""
    what = type(module).__name__
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise PrunusError(f"--pp-split: {what}'s forward takes {len(inputs)} inputs, not one; {FIX}")
    steps = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    prev, seen = inputs[0], []
    for node in steps:
        used = set(node.all_input_nodes)
        if node.op == "get_attr":
            raise PrunusError(f"--pp-split: {what}'s forward uses {node.target} directly, not through a child; {FIX}")
        if used != {prev}:
            late = sorted(n.name for n in used - {prev}) or ["nothing before it"]
            raise PrunusError(f"--pp-split: {what}'s forward is not a plain sequence of its children ({node.name} "
                              f"uses {', '.join(late)}, not only the step before it); {FIX}")
        if node.op == "call_module":
            top = str(node.target).split(".")[0]
            if seen and seen[-1] != top and top in seen:
                raise PrunusError(f"--pp-split: {what}'s forward calls the child {top} twice; {FIX}")
            if not seen or seen[-1] != top:
                seen.append(top)
        prev = node
    output = next(n for n in graph.nodes if n.op == "output")
    if output.args[0] is not prev:
        raise PrunusError(f"--pp-split: {what}'s forward does not return its last step's output alone; {FIX}")
    _check_order(module, seen)
    return steps


def _check_order(module: torch.nn.Module, called: list[str]) -> None:
    children = [n for n, c in module.named_children()]
    if called != [c for c in children if c in called]:
        raise PrunusError(f"--pp-split: {type(module).__name__}'s forward calls its children in the order "
                          f"{_names(called)}, not the order they were registered; {FIX}")
    holding = [n for n, c in module.named_children() if n not in called and any(True for _ in c.state_dict())]
    if holding:
        raise PrunusError(f"--pp-split: {type(module).__name__}'s child {holding[0]} holds weights but its forward "
                          f"never calls it; {FIX}")


def _stage_graph(steps: list[fx.Node]) -> fx.Graph:
    graph, env = fx.Graph(), {}
    env[steps[0].all_input_nodes[0]] = graph.placeholder("x")
    for node in steps:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[steps[-1]])
    return graph


def split_stages(module: torch.nn.Module, names: list[str]) -> list[fx.GraphModule]:
    """``len(names) + 1`` stage modules of ``module`` cut before each named child (see the module docstring)."""
    check_split_names(module, names)
    steps = _check_chain(module, _trace(module))
    cuts = []
    for name in names:
        at = next((i for i, n in enumerate(steps) if n.op == "call_module" and str(n.target).split(".")[0] == name), None)
        if at is None:
            raise PrunusError(f"--pp-split {name}: {type(module).__name__}'s forward never calls it; split at a "
                              "child the forward calls")
        cuts.append(at)
    bounds = list(zip([0, *cuts], [*cuts, len(steps)]))
    return [fx.GraphModule(module, _stage_graph(steps[a:b]), class_name=f"Stage{i}") for i, (a, b) in enumerate(bounds)]
