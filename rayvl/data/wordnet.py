"""WordNet 3.0 offline: nltk's reader over the copy `rayvl assets fetch` installs (Debian's wordnet package), for
the caption nouns of TOnICS' ontology (rayvl.methods.tonics.ontology) and the demo's paraphrases (rayvl.data.paraphrases)."""
from __future__ import annotations

import warnings
from functools import lru_cache

from rayvl import assets
from rayvl.data.text import NLTK_LOCK
from rayvl.private_copy import readable


@lru_cache(maxsize=1)
def wordnet():
    """nltk's WordNet reader over the offline WordNet 3.0 (loaded once per process: it takes a second)."""
    import nltk
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    class Reader(WordNetCorpusReader):
        def map_wn(self, version="wordnet"):
            # no Open Multilingual Wordnet here: nltk's own reader maps the loaded WordNet onto "wordnet" (itself)
            # at every load, reading index.sense twice — most of the load's time, in every read task's process
            return None

    root = readable(assets.require_wordnet())  # a group-writable install: nltk reads a private copy
    with NLTK_LOCK:
        if str(root) not in nltk.data.path:  # nltk reads corpora only from folders on its path
            nltk.data.path.insert(0, str(root))
        with warnings.catch_warnings():  # that it has no multilingual functions: none are used
            warnings.filterwarnings("ignore", "The multilingual functions")
            return Reader(nltk.data.find("corpora/wordnet"), None)
