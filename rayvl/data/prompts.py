"""Class prompts: the one source of prompt templates, and class files.

Templates are named sets in ``rayvl/resources/prompt_templates.json``: ``clip_imagenet`` (CLIP's 80 ImageNet
templates, open_clip's zero-shot set, and what evaluation sets that bring none get: ``DEFAULT_TEMPLATES``),
``clip_imagenet_short`` (six of them) and ``demo_shapes`` (the embedded demo's). At evaluation all templates of a class are averaged (``rayvl.eval.tasks``); image-label training
draws one a sample (rayvl.methods.unicl.prompts).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

TEMPLATES_FILE = Path(__file__).resolve().parent.parent / "resources" / "prompt_templates.json"
DEFAULT_TEMPLATES = "clip_imagenet"  # open_clip's zero-shot templates (OPENAI_IMAGENET_TEMPLATES, the same 80)
SINGLE_TEMPLATE = "a photo of a {}."  # CLIP's one-prompt baseline (Radford et al. 2021, §3.1.4)


@lru_cache(maxsize=None)
def templates(name: str = "clip_imagenet") -> tuple[str, ...]:
    sets = json.loads(TEMPLATES_FILE.read_text())
    if name not in sets:
        raise ValueError(f"no template set {name!r} (known: {', '.join(sets)})")
    return tuple(sets[name]["templates"])


BENCHMARK_TEMPLATES = "zeroshot_classification_templates.txt"  # CLIP_benchmark's, beside its classnames.txt


def read_class_file(path: str | Path, default_templates: str = DEFAULT_TEMPLATES) -> tuple[list[str], list[str]]:
    """(class names, templates) of a JSON file {"classes": [...], "templates": [...]} (or a bare list of names), or
    of CLIP_benchmark's ``classnames.txt`` (a name a line) with the templates of the
    ``zeroshot_classification_templates.txt`` beside it; a local path or a URL. A file without templates gets the
    named default set."""
    from rayvl import storage

    path = str(path)
    text = storage.read_text(path)
    if path.endswith(".txt"):
        beside = storage.join(storage.parent(path), BENCHMARK_TEMPLATES)
        given = [benchmark_template(t) for t in storage.read_text(beside).splitlines() if t.strip()] \
            if storage.is_file(beside) else None
        return [line.strip() for line in text.splitlines()], list(given or templates(default_templates))
    raw = json.loads(text)
    classes = raw["classes"] if isinstance(raw, dict) else raw
    given = raw.get("templates") if isinstance(raw, dict) else None
    return list(classes), list(given or templates(default_templates))


def benchmark_template(line: str) -> str:
    """A CLIP_benchmark template (``{c}`` where the class name goes, filled by ``format(c=...)``) as rayvl's
    (``{}``, filled by ``format(name)``), any other brace kept as written."""
    return line.strip().replace("{", "{{").replace("}", "}}").replace("{{c}}", "{}")
