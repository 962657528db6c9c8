"""What the driver resolves for the enabled methods' data (``rayvl.train.datasets`` asks here and names none of
them): each method's ``rows.py`` plans its ``DataPart`` before Ray starts — None when the method is off — and the
parts' row transforms apply in this order."""
from __future__ import annotations

from rayvl.methods.base import DataPart
from rayvl.methods.bow import rows as bow
from rayvl.methods.tonics import rows as tonics
from rayvl.methods.unicl import rows as unicl

# a caption is deformed ([BoW]) before its nouns make rows ([TOnICS]); image-label data is a stream of its own
PLANS = (bow.plan, tonics.plan, unicl.plan)


def parts(cfg, train: str, evalset: str) -> tuple[DataPart, ...]:
    """The enabled methods' data parts for a run reading ``train`` (and ``evalset``, '' = none); a problem is a
    ConfigError naming the key."""
    return tuple(part for part in (plan(cfg, train, evalset) for plan in PLANS) if part is not None)
