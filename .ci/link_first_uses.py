#!/usr/bin/env python3
"""Link the first prose use of each glossary term and each named API in a chapter.

Usage: python .ci/link_first_uses.py [-n] book/NAME.md ...   (-n: print, change nothing)

A term becomes {term}`word <term>` (book/glossary.md defines it); an API named in backticks
becomes a link to its reference page. Only prose is touched: not headings, tables, code, math,
links, roles or quotations. A term or API already linked in the chapter is left alone, so the
script can run again after a chapter changes. Run `jupytext --sync` on the chapters afterwards,
and read the diff: a word can match in a sense the glossary does not mean.
"""

from __future__ import annotations

import pathlib
import re
import sys

IC = re.IGNORECASE
# (glossary term, pattern, flags); longer phrases first, so that "mesh axis" wins over "mesh".
TERMS = [
    ("mesh axis", r"\bmesh ax(?:is|es)\b", IC),
    ("mesh", r"(?<![-\w`])mesh(?:es)?\b", IC),
    ("axis type", r"\baxis types?\b", IC),
    ("sharding", r"(?<![-\w`])shardings?\b", IC),
    ("replica", r"\breplicas?\b(?! groups?)", IC),
    ("collective", r"(?<![-\w])collectives?\b", IC),
    ("all-reduce", r"(?<![-\w])all-reduces?\b", IC),
    ("all-gather", r"(?<![-\w])all-gathers?\b", IC),
    ("reduce-scatter", r"(?<![-\w])reduce-scatters?\b", IC),
    ("all-to-all", r"(?<![-\w])all-to-alls?\b", IC),
    ("data parallelism", r"\bdata parallelism\b", IC),
    ("ZeRO", r"\bZeRO(?:-[123])?(?![-\w])", 0),
    ("FSDP", r"\bFSDP\b", 0),
    ("tensor parallelism", r"\btensor parallelism\b", IC),
    ("pipeline", r"\bpipeline parallelism\b", IC),
    ("bubble", r"\bbubble\b", IC),
    ("microbatch", r"\bmicro-?batch(?:es)?\b", IC),
    ("MFU", r"\bMFU\b", 0),
    ("remat", r"(?<![`.\w])remat\b(?!`)|\brematerialis\w*", IC),
    ("donation", r"\bdonat(?:ion|es|ed|e|ing)\b", IC),
    ("process", r"(?<![-\w`])process(?:es)?\b", IC),
    ("host", r"(?<![-\w`])hosts?\b", IC),
    ("SPMD", r"(?<![-\w])SPMD\b", 0),
    ("HLO", r"\bHLO\b", 0),
]

JAX = "https://docs.jax.dev/en/latest/_autosummary/"
SHARDING = "https://docs.jax.dev/en/latest/jax.sharding.html"
LINEN = "https://flax-linen.readthedocs.io/en/latest/api_reference/flax.linen/"
NNX_SPMD = "https://flax.readthedocs.io/en/latest/api_reference/flax.nnx/spmd.html"
OPTAX = "https://optax.readthedocs.io/en/latest/api/"
# (spellings in backticks, reference page); each page checked to exist before it was listed.
APIS = [
    (["jax.jit", "jit"], JAX + "jax.jit.html"),
    (["jax.make_mesh"], JAX + "jax.make_mesh.html"),
    (["jax.shard_map", "shard_map"], JAX + "jax.shard_map.html"),
    (["jax.pmap", "pmap"], JAX + "jax.pmap.html"),
    (["jax.device_put"], JAX + "jax.device_put.html"),
    (["jax.set_mesh"], JAX + "jax.set_mesh.html"),
    (
        ["jax.lax.with_sharding_constraint", "with_sharding_constraint"],
        JAX + "jax.lax.with_sharding_constraint.html",
    ),
    (
        ["jax.sharding.reshard", "reshard"],
        "https://docs.jax.dev/en/latest/201/sharding.html",
    ),
    (
        ["jax.sharding.NamedSharding", "NamedSharding"],
        SHARDING + "#jax.sharding.NamedSharding",
    ),
    (
        ["jax.sharding.PartitionSpec", "PartitionSpec"],
        SHARDING + "#jax.sharding.PartitionSpec",
    ),
    (["jax.sharding.Mesh", "Mesh"], SHARDING + "#jax.sharding.Mesh"),
    (["jax.checkpoint"], JAX + "jax.checkpoint.html"),
    (["jax.distributed.initialize"], JAX + "jax.distributed.initialize.html"),
    (
        ["jax.make_array_from_process_local_data"],
        JAX + "jax.make_array_from_process_local_data.html",
    ),
    (["jax.lax.psum", "lax.psum", "psum"], JAX + "jax.lax.psum.html"),
    (["jax.lax.pmean", "lax.pmean", "pmean"], JAX + "jax.lax.pmean.html"),
    (["jax.lax.ppermute", "ppermute"], JAX + "jax.lax.ppermute.html"),
    (["jax.eval_shape"], JAX + "jax.eval_shape.html"),
    (
        ["jax.profiler", "jax.profiler.trace"],
        "https://docs.jax.dev/en/latest/profiling.html",
    ),
    (
        [
            "optax.softmax_cross_entropy",
            "optax.softmax_cross_entropy_with_integer_labels",
        ],
        OPTAX + "losses.html",
    ),
    (["optax.MultiSteps"], OPTAX + "optimizer_wrappers.html#optax.MultiSteps"),
    (
        ["nn.with_partitioning", "flax.linen.with_partitioning"],
        LINEN + "spmd.html#flax.linen.with_partitioning",
    ),
    *(
        ([name], LINEN + "spmd.html")
        for name in (
            "nn.get_partition_spec",
            "nn.get_sharding",
            "nn.with_logical_partitioning",
            "nn.with_logical_constraint",
            "nn.logical_axis_rules",
            "nn.logical_to_mesh_sharding",
            "nn.Partitioned",
            "nn.LogicallyPartitioned",
        )
    ),
    *(
        ([name], NNX_SPMD)
        for name in (
            "nnx.with_partitioning",
            "nnx.get_partition_spec",
            "nnx.get_named_sharding",
        )
    ),
    (["nn.remat"], LINEN + "transformations.html"),
]
# Libraries named in plain prose.
LIBRARIES = [
    (r"\bOrbax\b", "https://orbax.readthedocs.io/en/latest/"),
    (r"\bTensorFlow Datasets\b|\bTFDS\b", "https://www.tensorflow.org/datasets"),
    (r"\bGrain\b", "https://google-grain.readthedocs.io/en/latest/"),
]

INLINE_CODE = re.compile(r"`[^`]*`")
UNTOUCHABLE = [  # math, links, roles, html, bare addresses, quotations
    re.compile(p)
    for p in (
        r"\$[^$]*\$",
        r"\[[^\]]*\]\([^)]*\)",
        r"\{[a-z]+\}`[^`]*`",
        r"<[^>]+>",
        r"https?://\S+",
        r"\"[^\"]*\"?",
    )
]


def prose_lines(text: str):
    """(start, end) of each prose line: not front matter, fences, headings, tables, labels, tags."""
    pos, fence, in_front = 0, None, text.startswith("---")
    for number, line in enumerate(text.splitlines(keepends=True)):
        start, pos = pos, pos + len(line)
        s = line.strip()
        if in_front:
            in_front = not (s == "---" and number > 0)
            continue
        if fence:
            if s.startswith(fence) and not s.strip("`~:"):
                fence = None
            continue
        if m := re.match(r"^(```+|~~~+|:::+)", s):
            fence = m.group(1)
            continue
        if (
            s.startswith(("#", "|", ":"))
            or s == "+++"
            or (s.startswith("(") and s.endswith(")="))
        ):
            continue
        yield start, pos


def already_linked(url: str, text: str) -> bool:
    """Whether the chapter links ``url`` already (for a library, any page of its site)."""
    site = re.match(r"https://[^/]+/", url)[0]
    return url in text or (url.endswith(("/latest/", "/datasets")) and site in text)


def find_first_uses(text: str) -> list[tuple[int, int, str]]:
    """(start, end, replacement) for the first unlinked use of each term and API."""
    linked = set(re.findall(r"\{term\}`(?:[^`<]*<)?([^`>]+)>?`", text))
    if any(t.startswith("ZeRO") for t in linked):
        linked.add("ZeRO")  # one entry point to the ZeRO family per chapter
    todo = [(re.compile(p, f), ("term", t)) for t, p, f in TERMS if t not in linked]
    for spellings, url in APIS:
        if not already_linked(url, text):
            alternatives = "|".join(re.escape(s) for s in spellings)
            todo.append(
                (re.compile(rf"`(?:{alternatives})(?:\([^`]*\))?`"), ("url", url))
            )
    todo += [
        (re.compile(p), ("url", url))
        for p, url in LIBRARIES
        if not already_linked(url, text)
    ]
    edits: list[tuple[int, int, str]] = []
    done: set[int] = set()
    quotes, previous_end = 0, None
    for start, end in prose_lines(text):
        line = text[start:end]
        if previous_end != start or not line.strip():
            quotes = 0  # a new paragraph
        previous_end = end
        opening = quotes % 2 == 1  # a quotation carried over from the line before
        quotes += line.count('"')
        blocked = [m.span() for p in UNTOUCHABLE for m in p.finditer(line)]
        if opening:
            close = line.find('"')
            blocked.append((0, close if close >= 0 else len(line)))
        code = [m.span() for m in INLINE_CODE.finditer(line)]
        for i, (pattern, (kind, target)) in enumerate(todo):
            if i in done:
                continue
            for m in pattern.finditer(line):
                a, b = m.span()
                word = m.group(0)
                inside = blocked + ([] if word.startswith("`") else code)
                if (
                    any(x <= a < y or x < b <= y for x, y in inside)
                    or line[a - 1 : a] == "["
                ):
                    continue
                if any(start + a < e and s < start + b for s, e, _ in edits):
                    continue
                if kind == "url":
                    new = f"[{word}]({target})"
                else:
                    # ZeRO-1, -2, -3 are entries too
                    ref = word if target == "ZeRO" else target
                    new = (
                        f"{{term}}`{word}`"
                        if word == ref
                        else f"{{term}}`{word} <{ref}>`"
                    )
                edits.append((start + a, start + b, new))
                done.add(i)
                break
    return edits


def main(argv: list[str]) -> int:
    dry = "-n" in argv
    for name in (a for a in argv[1:] if a != "-n"):
        path = pathlib.Path(name)
        text = path.read_text()
        for a, b, new in sorted(find_first_uses(text), reverse=True):
            print(f"{path.name}:{text.count(chr(10), 0, a) + 1}: {new}")
            text = text[:a] + new + text[b:]
        if not dry:
            path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
