"""Every method's config check, in one list: ``rayvl.config.validate`` runs them after its own checks, so the
config check itself names no method. Each check is torch-free, reads the config tree duck-typed and raises
``rayvl.errors.ConfigError`` naming the dotted key; a check runs whether or not its method is on (a wrong value is
wrong before anyone switches the method on)."""
from __future__ import annotations

from rayvl.methods.bow import check as bow
from rayvl.methods.paraphrase import check as paraphrase
from rayvl.methods.tonics import check as tonics
from rayvl.methods.unicl import check as unicl

CHECKS = (paraphrase.check, bow.check, unicl.check, tonics.check)


def check(cfg) -> None:
    """Each method's constraints on ``cfg``, in order; the first one broken raises."""
    for method_check in CHECKS:
        method_check(cfg)
