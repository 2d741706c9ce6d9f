"""explain: for one op call, the candidate strategies, their costs, and why the chosen one won."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spmd.tensor.dispatch.dispatcher import DISPATCHER
from spmd.tensor.sharding.vocabulary import OpStrategy
from spmd.tensor.trace import human_bytes

__all__ = ["explain", "Explanation"]


@dataclass(frozen=True, slots=True)
class Explanation:
    """The propagator's view of one call: per mesh dim, every candidate with its cost."""

    op: str
    inputs: tuple[str, ...]
    per_mesh_dim: tuple[tuple[tuple[OpStrategy, float | None], ...], ...]
    chosen: tuple[OpStrategy, ...]
    decomposition: str | None = None
    """When set, these inputs run the op as other DTensor ops (named here), each decided as it runs;
    the rule's candidates below are then not used."""

    def __str__(self) -> str:
        lines = [f"{self.op}", *(f"  input {i}: {text}" for i, text in enumerate(self.inputs))]
        if self.decomposition is not None:
            lines.append(f"  runs as other DTensor ops ({self.decomposition}), each decided when it runs;")
            lines.append("  the rule's candidates below are not used for these inputs")
        for d, scored in enumerate(self.per_mesh_dim):
            lines.append(f"  mesh dim {d}:")
            width = max((len(str(c)) for c, _ in scored), default=0)
            for candidate, cost in scored:
                mark = "->" if candidate == self.chosen[d] else "  "
                if cost is None:
                    price = "not allowed (in-place ops keep self's placement)"
                else:
                    # Local steps carry a token cost (a copy); below a byte nothing crosses ranks.
                    price = "no communication" if cost < 1 else f"moves {human_bytes(cost)}"
                lines.append(f"    {mark} {candidate!s:<{width}}  {price}")
            lines.append(f"    chosen: {self.chosen[d]}: {self._why(d)}")
        return "\n".join(lines)

    def _why(self, d: int) -> str:
        costs = [cost for _, cost in self.per_mesh_dim[d] if cost is not None]
        best = min(costs)
        ties = sum(1 for c in costs if c == best)
        reason = "the least data to move" if best >= 1 else "no communication"
        return reason + (f" (first of {ties} equal candidates, in the rule's order)" if ties > 1 else "")


def explain(op: Any, *args: Any, **kwargs: Any) -> Explanation:
    """How DTensor would run aten ``op`` on these arguments, without running it.

    >>> print(explain(torch.ops.aten.mm.default, a, b))  # doctest: +SKIP
    aten.mm.default
      input 0: f32[8,6] (S(1)) on mesh(d0=4)
      ...
    """
    call = DISPATCHER.make_call(op, args, kwargs)
    propagator = DISPATCHER.propagator
    decomposed = propagator.decompose(call)
    candidates = propagator.candidates(call)
    decision = propagator.decide(call)
    per_dim = tuple(tuple(propagator.score(call, candidates, d)) for d in range(call.input_specs[0].mesh.ndim))
    inputs = tuple(str(spec) for spec in call.input_specs)
    return Explanation(str(op), inputs, per_dim, decision.strategies, _expansion_name(decomposed))


def _expansion_name(decision: Any) -> str | None:
    if decision is None:
        return None
    expansion = decision.decomposition
    return str(getattr(getattr(expansion, "func", expansion), "__name__", expansion))
