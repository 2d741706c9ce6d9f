"""spmd.compat: run third-party code written for ``torch.distributed.tensor`` on spmd, without editing it.

>>> import spmd.compat  # doctest: +SKIP
>>> spmd.compat.redirect("torchtitan")  # before anything imports torchtitan  # doctest: +SKIP
>>> import torchtitan.train  # its torch DTensor imports now resolve to spmd  # doctest: +SKIP

or, under torchrun: ``torchrun --nproc-per-node 2 -m spmd.run --redirect torchtitan -m torchtitan.train``.

Modules, one job each::

  module_map.py  the one torch -> spmd module map
  rewrite.py     rewrites a module's syntax tree: its imports of torch's DTensor modules reach spmd's
  resolve.py     what the rewritten imports call at run time (and the errors for what spmd lacks)
  redirect.py    which packages are redirected, and the import hook that rewrites them as they load
  audit.py       ``python -m spmd.compat.audit PKG``: what the redirect would do with a package, before switching
  audit_report.py  ``audit()`` and its report; sources.py, uses.py and verdicts.py are its steps
"""

from spmd.compat.audit_report import audit
from spmd.compat.redirect import RedirectError, redirect, redirected, redirecting, undo
from spmd.compat.resolve import NoSpmdEquivalentError

__all__ = ["redirect", "redirected", "redirecting", "undo", "audit", "RedirectError", "NoSpmdEquivalentError"]
