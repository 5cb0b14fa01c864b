#!/usr/bin/env python3
"""Write each Chinese paragraph of a Markdown page on one line, with the glossary's terms.

A line break inside a paragraph renders as a space in a browser, and between two Chinese
characters that space is a visible gap. This tool joins the lines of every paragraph
(and of every list item) that contains a Chinese character: with nothing between two
wide characters (Han, CJK and full-width punctuation, curly quotes) or next to wide
punctuation, with one space otherwise (Chinese next to `code` or an English word keeps
the usual space).

Left as they are: fenced code blocks, tables, headings, block quotes, HTML lines, link
definitions, thematic breaks, hard line breaks (two trailing spaces or a backslash),
paragraphs without a Chinese character, and the list structure (each item keeps its
marker and indentation; a nested item starts its own line). Running it twice changes
nothing the second time.

It also writes the one term of the glossary (the table under "## 术语表" in
docs/zh/README.md: English | the term used | variants not used) for each variant, in
prose and outside `code` (the glossary itself aside); a variant whose entry names two
terms ("前向 / 反向") is left for a person to choose.

Usage: python scripts/zh_reflow.py [--check] FILE...   (no FILE: README.zh-CN.md and docs/zh/*.md)
--check changes nothing and exits 1 when a file would change.
"""

import argparse
import re
import sys
from pathlib import Path
from typing import List, Tuple

WIDE = "\u2018\u2019\u201c\u201d\u2026\u2014\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_WIDE = re.compile(f"[{WIDE}]")
_HAN = re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_WIDE_PUNCT = re.compile("[\u2018\u2019\u201c\u201d\u2026\u2014\u3000-\u303f\uff00-\uffef]")
_FENCE = re.compile(r"^\s*(```+|~~~+)")
_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
# lines that are a block of their own: headings, tables, quotes, HTML, link definitions, rules
_BLOCK = re.compile(r"^\s*(?:#{1,6}\s|\||>|<|\[[^\]]+\]:\s|(?:[-*_]\s*){3,}$)")


def _hard_break(line: str) -> bool:
    return line.endswith("  ") or line.endswith("\\")


def _join(lines: List[str]) -> str:
    out = lines[0]
    for nxt in lines[1:]:
        # a hard break (trailing spaces) can only end the last line: it is kept there
        out, nxt = out.rstrip(), nxt.lstrip()
        tight = (_WIDE.match(out[-1]) and _WIDE.match(nxt[0])) or _WIDE_PUNCT.match(out[-1]) \
            or _WIDE_PUNCT.match(nxt[0])
        out += ("" if tight else " ") + nxt
    return out


def reflow(text: str) -> str:
    """The page with each Chinese paragraph and list item on one line."""
    lines = text.split("\n")
    out: List[str] = []
    unit: List[str] = []  # the lines of the paragraph or list item being read

    def flush() -> None:
        if unit:
            out.append(_join(unit) if any(_HAN.search(u) for u in unit) else "\n".join(unit))
            unit.clear()

    fence = None
    for line in lines:
        if fence is not None:
            out.append(line)
            if line.strip().startswith(fence):
                fence = None
            continue
        m = _FENCE.match(line)
        if m:
            flush()
            fence = m.group(1)
            out.append(line)
        elif not line.strip() or _BLOCK.match(line):
            flush()
            out.append(line)
        elif _ITEM.match(line):
            flush()
            unit.append(line)
        else:
            unit.append(line)
        if unit and _hard_break(unit[-1]):
            flush()
    flush()
    return "\n".join(out)


GLOSSARY_HEADING = "## 术语表"
_ASCII_WORD = re.compile(r"[A-Za-z0-9]")


def glossary(text: str) -> List[Tuple[str, str]]:
    """[(variant, the term used)] from the glossary table of ``text``, longest variant
    first (微批次 before 微批)."""
    start = text.find("\n" + GLOSSARY_HEADING + "\n")
    if start < 0:
        return []
    end = text.find("\n## ", start + 1)
    pairs = []
    for line in text[start:end if end >= 0 else len(text)].split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or set(cells[1]) <= {"-"} or cells[1] == "统一用":
            continue
        used = re.sub(r"（.*?）", "", cells[1]).strip()
        if "/" in used:
            continue
        pairs += [(v.strip(), used) for v in re.split(r"[、,，]", cells[2]) if v.strip()]
    return sorted(pairs, key=lambda p: -len(p[0]))


def _replace_terms(prose: str, terms: List[Tuple[str, str]]) -> str:
    """``prose`` (no code span) with each variant replaced; a space between the term and
    a neighbouring Chinese character when the term is an English word."""
    for variant, used in terms:
        out, i = [], 0
        for m in re.finditer(re.escape(variant), prose):
            before = prose[m.start() - 1] if m.start() else ""
            after = prose[m.end()] if m.end() < len(prose) else ""
            word = used
            if _ASCII_WORD.match(used[0]) and before and _HAN.match(before):
                word = " " + word
            if _ASCII_WORD.match(used[-1]) and after and _HAN.match(after):
                word += " "
            out += [prose[i:m.start()], word]
            i = m.end()
        prose = "".join(out) + prose[i:]
    return prose


def fix_terms(text: str, terms: List[Tuple[str, str]]) -> str:
    """``text`` with the glossary's variants replaced outside code blocks, code spans and
    the glossary section."""
    if not terms:
        return text
    lines = text.split("\n")
    fence = None
    in_glossary = False
    for k, line in enumerate(lines):
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        m = _FENCE.match(line)
        if m:
            fence = m.group(1)
            continue
        if line.startswith("## "):
            in_glossary = line.strip() == GLOSSARY_HEADING
        if in_glossary:
            continue
        pieces = line.split("`")
        lines[k] = "`".join(_replace_terms(p, terms) if i % 2 == 0 else p for i, p in enumerate(pieces))
    return "\n".join(lines)


def default_pages(root: Path) -> List[Path]:
    return sorted([*root.glob("README.zh-CN.md"), *(root / "docs" / "zh").glob("*.md")])


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file would change")
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    files = args.files or default_pages(root)
    readme = root / "docs" / "zh" / "README.md"
    terms = glossary(readme.read_text(encoding="utf-8")) if readme.is_file() else []
    changed = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        new = reflow(fix_terms(text, terms))
        if new != text:
            changed.append(path)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    verb = "would change" if args.check else "reflowed"
    for path in changed:
        print(f"{verb}: {path}")
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
