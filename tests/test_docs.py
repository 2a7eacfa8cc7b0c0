"""The documents work as written: their commands, modules, links and files exist.

Every command line of train.py, launch.py, bench.py, the tfdist-* commands and each
``python -m`` target is read against its real parser (the part after ``launch.py ... --``
against train.py's); every relative link and #anchor resolves; docs/reference.md's flag
tables are the parsers' own. Each check is also run on a planted bad document, so it is
known to fail when a doc names a flag, module or file that does not exist.
"""

import pytest

import docs_check as dc
from conftest import REPO

DOCS = dc.documents()
IDS = [d.relative_to(REPO).as_posix() for d in DOCS]


def test_the_checks_read_every_document():
    assert {"README.md", "docs/reference.md", "docs/launcher.md", "docs/contributing.md",
            "slurm/README.md", "k8s/README.md"} <= set(IDS)


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_command_lines_use_real_flags_and_modules(doc):
    assert dc.check_commands(doc.read_text(), doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_flags_named_in_prose_exist(doc):
    assert dc.check_prose_flags(doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_python_examples_call_the_api_as_it_is(doc):
    assert dc.check_python_calls(doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_links_and_anchors_resolve(doc):
    assert dc.check_links(doc.read_text(), doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_files_named_exist(doc):
    assert dc.check_file_names(doc.read_text(), doc) == []


def test_reference_flag_tables_are_the_parsers():
    regions = dc.reference_regions(dc.REFERENCE.read_text())
    assert set(regions) == set(dc.TABLES), "docs/reference.md needs one table region per command"
    for name, command in dc.TABLES.items():
        assert regions[name] == dc.flag_table(command), (
            f"docs/reference.md's {name} table is not its parser's: "
            "run `python tests/docs_check.py --write`")


@pytest.mark.parametrize("command", sorted(set(dc.TABLES.values())))
def test_a_generated_table_holds_every_flag(command):
    table = dc.flag_table(command)
    p = dc.parser(command)
    visible = {s for a in p._actions if a.option_strings and a.help != "==SUPPRESS=="
               for s in a.option_strings} - {"-h", "--help"}
    assert visible and all(f"`{flag}`" in table for flag in visible)


def test_the_docs_speak_of_the_product_not_its_making():
    import re
    words = re.compile(r"session|done[- ]when|done check|earlier commit|slower hour|mended", re.I)
    found = [f"{d.relative_to(REPO)}:{n}: {line.strip()}"
             for d in DOCS for n, line in enumerate(d.read_text().splitlines(), 1)
             if words.search(line)]
    assert found == []


def test_the_readme_starts_with_what_a_newcomer_needs():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    head = "\n".join(lines[:80])
    for needed in ("pip install", "tfdist.fit(", "make demo", "make test"):
        assert needed in head, needed
    text = "\n".join(lines)
    unlinked = [d.name for d in sorted((REPO / "docs").glob("*.md"))
                if f"](docs/{d.name})" not in text]
    assert unlinked == [], "the README's Where to go next must link every doc"


# --- each check fails on a planted bad document --------------------------------------------

PLANTED = [
    ("`python launch.py --strategy ps --ps-shards 2 -- --epochs 1`", "launch: no flag --ps-shards"),
    ("```bash\n.venv/bin/python launch.py --strategy ps --workers 2 \\\n    -- --runs 3\n```",
     "train (after --): no flag --runs"),
    ("`tfdist-train --strategy=none --learnin-rate 0.1`", "train: no flag --learnin-rate"),
    ("```\nbench.py --suite scenarios --no-such-study   # a comment --ignored\n```",
     "bench: no flag --no-such-study"),
    ("a span that wraps, `launch.py --strategy ps --hosts 3\n  --no-such-flag`, is read whole",
     "launch: no flag --no-such-flag"),
    ("an indented block:\n\n    python bench.py --suite scenarios --links-only\n\nafter it",
     "bench: no flag --links-only"),
    ("`python -m training.prepare_data`", "python -m training.prepare_data: no such module"),
    ("`python -m tfdist.cli.tools.soak --runs 3`", "tfdist.cli.tools.soak: no flag --runs"),
    ("`python launch.py --strategy ps --program bench/peers/tf_keras_ps.py -- --epochs 1`",
     "--program bench/peers/tf_keras_ps.py: no such file"),
]


@pytest.mark.parametrize("text,problem", PLANTED, ids=[p for _, p in PLANTED])
def test_a_bad_command_line_is_named(text, problem):
    found = dc.check_commands(text)
    assert len(found) == 1 and found[0].startswith(problem), found


def test_good_command_lines_pass():
    good = ("```bash\npython launch.py --strategy ps --workers 2 --ps 1 --hosts 3 "
            "--slow worker:1=0.25 -- --epochs 1 --model-dir runs/x  # a comment --x\n"
            "TF_CONFIG='...' tfdist-train --strategy=auto --dry-run\n"
            "python -m tfdist.cli.tools.soak --jobs 3 --out runs/soak\n"
            "python launch.py --strategy ps --program tfdist/bench/peers/tf_keras_ps.py "
            "-- --peer-only-flag\n```\n")
    assert dc.check_commands(good) == []


def test_a_flag_in_prose_that_no_command_has_is_named():
    found = dc.check_prose_flags("so `--ps-shards > 1` is refused, and `--stuck-timeout` bounds it")
    assert found == ["no command has the flag --ps-shards (in: `--ps-shards > 1`)"]


def test_a_python_example_with_a_keyword_the_api_lacks_is_named():
    real = sorted(dc._api_keywords("launch")[0])[0]  # a keyword launch() has, whatever the API
    text = ("```python\nimport tfdist\n"
            f"tfdist.launch('ps', {real}=None)\n"
            "tfdist.launch('ps', kil=['worker:1@20'])\ntfdist.fitt('x')\n```\n")
    assert dc.check_python_calls(text) == ["tfdist.launch(): no keyword kil",
                                           "tfdist.fitt: no such name in tfdist"]


def test_a_broken_link_or_anchor_is_named():
    doc = REPO / "docs" / "planted.md"
    text = ("# A heading\n\n[ok](#a-heading) [ok](reference.md#security) "
            "![plot](results/accuracy_vs_time.png) [gone](nothere.md) "
            "[bad anchor](../README.md#no-such-heading) [web](https://example.com/x)\n"
            "```\n[in code](ignored.md)\n```\n")
    found = dc.check_links(text, doc)
    assert len(found) == 3, found
    assert "results/accuracy_vs_time.png: no file docs/results/accuracy_vs_time.png" in found[0]
    assert "nothere.md" in found[1] and "#no-such-heading" in found[2]


def test_a_missing_file_named_in_code_is_named():
    doc = REPO / "docs" / "planted.md"
    found = dc.check_file_names("see `tfdist/launcher/plan.py: place_tasks`, `launcher/job.py`"
                                " and `tfdist/launcher/gone.py`, `runs/x/results.json`", doc)
    assert found == ["no file tfdist/launcher/gone.py (in: `tfdist/launcher/gone.py`)"]
    block = '```bash\nTF_CONFIG="$(cat TF_CONFIG_examples/ps/chief-9.json)" tfdist-train --dry-run\n```\n'
    assert dc.check_file_names(block, doc) == [
        'no file TF_CONFIG_examples/ps/chief-9.json (in: TF_CONFIG="$(cat '
        'TF_CONFIG_examples/ps/chief-9.json)" tfdist-train --dry-run)']


def test_a_table_missing_a_flag_is_not_the_generated_one():
    table = dc.flag_table("launch")
    assert "`--timeout`" in table
    without = "\n".join(line for line in table.splitlines() if "`--timeout`" not in line)
    assert without != table


def test_anchors_follow_githubs_rule():
    text = "# Stuck tasks found within `--stuck-timeout`\n## Set-up: the two commands\n## A\n## A\n"
    assert dc.anchors(text) == {"stuck-tasks-found-within---stuck-timeout",
                                "set-up-the-two-commands", "a", "a-1"}
