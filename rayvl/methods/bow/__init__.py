"""[BoW] Bag-of-Words captions: the caption deformation cascade and its base-split statistics (``deformation``,
§2.2), the EMA memory bank of negatives (``memory_bank``, §2.1), pseudo-BoW captions' word ranking (``word_rank``,
§2.3); ``check``: their config constraints, ``rows``: the deformation of training rows, ``train``: the bank's
training part."""
