"""What a newcomer reads first says what they need, once.

* The README's install command names the extra of every example the README runs, and it is
  the only install of extras outside the test command.
* The hierarchical-allreduce page shows how to try it on one machine; the migration page
  documents the ``horovodrun`` switch; code blocks on the site wrap long commands.

Plain text checks (no mkdocs needed); tests/test_docs.py builds the site itself.
"""
import os
import re
from typing import List, Set

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")


def _read(*parts: str) -> str:
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def _installed_extras(command: str) -> List[Set[str]]:
    """The extras of each ``pip install -e '.[...]'`` in a command line."""
    return [set(e.strip() for e in group.split(","))
            for group in re.findall(r"pip install (?:-q )?-e '\.\[([\w,]+)\]'", command)]


def _needed_extras(text: str) -> Set[str]:
    """The extras the examples a page runs need (examples/<name>.py)."""
    needed = set()
    for name in re.findall(r"examples/(\w+)\.py", text):
        needed.add("examples")
        if name.startswith("ray_"):
            needed.add("ray")
        elif name.startswith("spark_"):
            needed.add("spark")
        elif name.startswith(("keras_", "tensorflow")):
            needed.add("tensorflow")
        elif name.startswith("lightning_"):
            needed.add("lightning")
    return needed


def test_readme_installs_every_extra_its_examples_need_once():
    readme = _read("README.md")
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    installs = [extras for block in blocks for line in block.splitlines()
                if "pytest" not in line for extras in _installed_extras(line)]
    assert len(installs) == 1, installs
    needed = _needed_extras(readme)
    assert {"examples", "ray", "spark", "tensorflow"} <= needed  # the README's own examples
    assert needed <= installs[0], needed - installs[0]


def test_hierarchical_page_shows_one_machine_try():
    page = _read("docs", "hierarchical-allreduce.md")
    assert re.search(r"```bash\naiakrun --virtual-hosts -H a:2,b:2 -np 4 python \S+\.py\n```",
                     page), "no one-machine command on the hierarchical-allreduce page"


def test_migration_page_documents_horovodrun():
    page = _read("docs", "horovod.md")
    section = page.split("### A `horovodrun` command", 1)[1].split("\n## ", 1)[0]
    assert "AIAK_HOROVODRUN=1 python3 -m pip install" in section
    assert "horovod-*.dist-info" in section        # why it never replaces Horovod's


def test_code_blocks_wrap():
    # A list under the top-level key (read as text: PyYAML comes only with the docs extra).
    listed = re.search(r"^extra_css:\n((?:  - .*\n)+)", _read("mkdocs.yml"), re.M)
    sheets = re.findall(r"  - (\S+)", listed.group(1)) if listed else []
    assert sheets, "mkdocs.yml names no extra stylesheet"
    css = "".join(_read("docs", sheet) for sheet in sheets)
    rule = re.search(r"\.md-typeset pre > code\s*\{([^}]*)\}", css)
    assert rule and re.search(r"white-space:\s*pre-wrap", rule.group(1)), css
