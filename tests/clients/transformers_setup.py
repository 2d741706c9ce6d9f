"""Import Hugging Face transformers on spmd: importing this module redirects transformers (and
accelerate, which it imports) to spmd, before anything imports them.

Import it first, in pytest and in every gloo process that should run on spmd; a gloo process that
imports only ``transformers_program`` runs the same program on torch's own DTensor.
"""

from __future__ import annotations

import spmd.compat

spmd.compat.redirect("transformers", "accelerate")

import transformers_program  # noqa: E402

__all__ = ["run_on_rank"]


def run_on_rank(jobs: list[tuple[transformers_program.Case, str]], out_root: str) -> list[dict[str, object]]:
    """``transformers_program.run_on_rank`` on spmd: a target for gloo processes."""
    return transformers_program.run_on_rank(jobs, out_root)
