"""Check that the project's text and code are its own, not Horovod's.

Compares every Python, C++ and CUDA file of the project with a Horovod source tree and
reports two kinds of overlap:

* three or more consecutive non-trivial lines that also appear, in order, in a Horovod file
  (lines compared with whitespace collapsed);
* a run of twelve or more consecutive words that also appears in Horovod's prose (comments,
  docstrings and string literals; words lower-cased, punctuation dropped).

Strings that Horovod users match on are kept verbatim on purpose.  They all live in
``aiak_training/common/horovod_strings.py``; a word run inside one of them is not reported.

Get Horovod's source from PyPI, then point the tool at it::

    pip download horovod==0.28.1 --no-deps --no-binary :all: -d /tmp/hvd
    tar xzf /tmp/hvd/horovod-0.28.1.tar.gz -C /tmp/hvd
    python3 tools/provenance_check.py /tmp/hvd/horovod-0.28.1

Exit status 0 when nothing overlaps, 1 otherwise.
"""
import argparse
import ast
import io
import os
import re
import sys
import tokenize
from typing import Dict, Iterable, List, Set, Tuple

LINE_RUN = 3
WORD_RUN = 12
SOURCE_SUFFIXES = (".py", ".cc", ".cpp", ".h", ".cu", ".cuh")
PROJECT_DIRS = ("aiak_training", "csrc", "benchmarks", "examples", "tests", "tools")
ALLOWED_MODULE = os.path.join("aiak_training", "common", "horovod_strings.py")
# Lines that say nothing on their own: closing brackets, bare keywords, short fragments.
_TRIVIAL = re.compile(r"^(?:[\s\)\]\}\(\[\{,:;]*|(?:else|try|finally|pass|break|continue|return"
                      r"|\"\"\"|'''|#|//|\*/|/\*|\*|@staticmethod|@property)[:;]?)$")
_WORD = re.compile(r"[a-z0-9_]+")
# Import statements and C/C++ includes name modules and headers, which any two programs using
# them share: facts, not text.
_IMPORT = re.compile(r"^(?:import [\w., ]+|from [\w.]+ import [\w., ()]+|#include [<\"][\w./]+[>\"])$")


def _source_files(root: str, subdirs: Iterable[str] = ("",)) -> Iterable[str]:
    for sub in subdirs:
        top = os.path.join(root, sub)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if d not in ("third_party", "__pycache__", ".git",
                                                            "build", "horovod_shim")]
            for f in filenames:
                if f.endswith(SOURCE_SUFFIXES):
                    yield os.path.join(dirpath, f)


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def _norm_line(line: str) -> str:
    return " ".join(line.split())


def _significant(line: str) -> bool:
    return len(line) >= 12 and not _TRIVIAL.match(line) and not _IMPORT.match(line)


def _prose_of_python(text: str) -> List[str]:
    """Comments, docstrings and string literals of a Python file; adjacent literals (implicit
    concatenation or ``+``) are joined, so a sentence split over lines is read whole."""
    out: List[str] = []
    pending: List[str] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.STRING:
                try:
                    value = ast.literal_eval(tok.string)
                except (ValueError, SyntaxError):
                    value = tok.string
                if isinstance(value, bytes):
                    value = value.decode("utf-8", "replace")
                pending.append(str(value))
                continue
            if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT) \
                    or tok.string == "+":
                continue
            if pending:
                out.append("".join(pending))
                pending = []
            if tok.type == tokenize.COMMENT:
                out.append(tok.string.lstrip("#"))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        out.append(text)
    if pending:
        out.append("".join(pending))
    return out


_C_PROSE = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"", re.S)
_C_JOIN = re.compile(r"\s*(?:<<\s*)?")


def _prose_of_c(text: str) -> List[str]:
    """Comments and string literals; literals next to each other (or streamed one after the
    other with ``<<``) are joined into one."""
    out: List[str] = []
    last_end, last_was_string = -1, False
    for m in _C_PROSE.finditer(text):
        token = m.group(0)
        is_string = token.startswith('"')
        body = token[1:-1] if is_string else token.strip("/*")
        if is_string and last_was_string and _C_JOIN.fullmatch(text, last_end, m.start()):
            out[-1] += body
        else:
            out.append(body)
        last_end, last_was_string = m.end(), is_string
    return out


def _prose(path: str, text: str) -> List[str]:
    return _prose_of_python(text) if path.endswith(".py") else _prose_of_c(text)


def _words(chunks: Iterable[str]) -> List[str]:
    words: List[str] = []
    for chunk in chunks:
        words.extend(_WORD.findall(chunk.lower()))
        words.append("\x00")  # a run never spans two comments or strings
    return words


def _runs(words: List[str], n: int) -> Iterable[Tuple[int, Tuple[str, ...]]]:
    for i in range(len(words) - n + 1):
        run = tuple(words[i:i + n])
        if "\x00" not in run:
            yield i, run


class Reference:
    """Line triples and word runs of a Horovod tree, for lookups."""

    def __init__(self, root: str):
        self.line_triples: Dict[Tuple[str, ...], str] = {}
        self.word_runs: Dict[Tuple[str, ...], str] = {}
        for path in _source_files(root):
            text = _read(path)
            rel = os.path.relpath(path, root)
            lines = [l for l in (_norm_line(x) for x in text.splitlines()) if _significant(l)]
            for i in range(len(lines) - LINE_RUN + 1):
                self.line_triples.setdefault(tuple(lines[i:i + LINE_RUN]), rel)
            for _, run in _runs(_words(_prose(path, text)), WORD_RUN):
                self.word_runs.setdefault(run, rel)


def _allowed_runs(project: str) -> Set[Tuple[str, ...]]:
    path = os.path.join(project, ALLOWED_MODULE)
    if not os.path.exists(path):
        return set()
    return {run for _, run in _runs(_words(_prose_of_python(_read(path))), WORD_RUN)}


def check(project: str, reference: Reference) -> List[str]:
    allowed = _allowed_runs(project)
    findings = []
    for path in sorted(_source_files(project, PROJECT_DIRS)):
        rel = os.path.relpath(path, project)
        if rel == ALLOWED_MODULE or rel == os.path.join("tools", "provenance_check.py"):
            continue
        text = _read(path)
        numbered = [(n, _norm_line(x)) for n, x in enumerate(text.splitlines(), 1)]
        numbered = [(n, l) for n, l in numbered if _significant(l)]
        reported_until = -1
        for i in range(len(numbered) - LINE_RUN + 1):
            key = tuple(l for _, l in numbered[i:i + LINE_RUN])
            src = reference.line_triples.get(key)
            if src and numbered[i][0] > reported_until:
                reported_until = numbered[i + LINE_RUN - 1][0]
                findings.append(f"{rel}:{numbered[i][0]}: {LINE_RUN} lines as in {src}: "
                                f"{key[0][:70]!r}")
        words = _words(_prose(path, text))
        skip_to = -1
        for i, run in _runs(words, WORD_RUN):
            if i < skip_to or run in allowed:
                continue
            src = reference.word_runs.get(run)
            if src:
                skip_to = i + WORD_RUN
                findings.append(f"{rel}: {WORD_RUN} words as in {src}: {' '.join(run)!r}")
    return findings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("horovod_root", help="an unpacked Horovod source tree")
    parser.add_argument("--project", default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), help="the project root (default: this checkout)")
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.join(args.horovod_root, "horovod")):
        parser.error(f"{args.horovod_root} has no horovod/ package")
    findings = check(args.project, Reference(args.horovod_root))
    for line in findings:
        print(line)
    print(f"{len(findings)} overlap(s) with Horovod's source")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
