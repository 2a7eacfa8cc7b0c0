"""Reads the project's documents the way a user follows them, and names what would not work.

Each ``check_*`` function takes one document's text (and its path, for relative links) and
returns a list of problems, one line each, so a test can run it on a real document or on a
planted bad one. The command lines are checked against the real parsers: each command's
``main``/``parse_args`` is called with ``argparse.ArgumentParser.parse_known_args`` patched to
hand back the parser it built, so nothing runs.

``python tests/docs_check.py --write`` regenerates docs/reference.md's flag tables (between
its ``<!-- flags: NAME -->`` and ``<!-- /flags -->`` markers) from the parsers.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def documents() -> list[Path]:
    """Every document a user reads: the README, docs/, and the READMEs beside examples and set-ups."""
    found = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for folder in ("examples", "k8s", "slurm", "TF_CONFIG_examples"):
        found += sorted((REPO / folder).glob("*.md"))
    return found


# --- the parsers ----------------------------------------------------------------------------

class _Built(Exception):
    def __init__(self, parser):
        self.parser = parser


def _capture(call) -> argparse.ArgumentParser:
    """The parser ``call`` builds, taken at its first parse: nothing after it runs."""
    original = argparse.ArgumentParser.parse_known_args

    def grab(self, *args, **kwargs):
        raise _Built(self)

    argparse.ArgumentParser.parse_known_args = grab
    try:
        call()
    except _Built as built:
        return built.parser
    finally:
        argparse.ArgumentParser.parse_known_args = original
    raise AssertionError(f"{call} built no parser")


def _module_main(module: str):
    return lambda: importlib.import_module(module).main([])


def _parse_args(module: str):
    return lambda: importlib.import_module(module).parse_args([])


# A command's name -> how to reach its parser. The checkout's scripts, the installed commands
# and their ``python -m`` forms share one parser each.
PARSER_SOURCES = {
    "train": _parse_args("tfdist.cli.train"),
    "launch": _parse_args("tfdist.cli.launch"),
    "bench": _parse_args("tfdist.cli.bench"),
    "tfdist.cli.tools.soak": _parse_args("tfdist.cli.tools.soak"),
    "tfdist.cli.tools.link_table": _module_main("tfdist.cli.tools.link_table"),
    "tfdist.cli.tools.hosts": _module_main("tfdist.cli.tools.hosts"),
    "tfdist.cli.tools.traffic": _module_main("tfdist.cli.tools.traffic"),
    "tfdist.cli.tools.prepare_data": _module_main("tfdist.cli.tools.prepare_data"),
    "tfdist.cli.tools.overlap": _module_main("tfdist.cli.tools.overlap"),
    "tfdist.cli.tools.trace_study": _module_main("tfdist.cli.tools.trace_study"),
}
MODULE_COMMANDS = {"tfdist.cli.train": "train", "tfdist.cli.launch": "launch",
                   "tfdist.cli.bench": "bench"}
SCRIPT_COMMANDS = {"train.py": "train", "launch.py": "launch", "bench.py": "bench",
                   "tfdist-train": "train", "tfdist-launch": "launch", "tfdist-bench": "bench"}


@functools.lru_cache(maxsize=None)
def parser(name: str) -> argparse.ArgumentParser:
    return _capture(PARSER_SOURCES[name])


def flags_of(name: str) -> set[str]:
    return {s for a in parser(name)._actions for s in a.option_strings}


@functools.lru_cache(maxsize=None)
def all_flags() -> frozenset[str]:
    return frozenset().union(*(flags_of(n) for n in PARSER_SOURCES))


# Flags of other programs that the documents name on their own, in prose (`--flag`).
OTHER_PROGRAMS_FLAGS = {
    "--help",
    # srun / sbatch
    "--cpus-per-task", "--ntasks-per-node", "--nodes", "--requeue", "--signal", "--gres",
    "--distribution", "--kill-on-bad-exit", "--gpus-per-task", "--open-mode",
    # podman / docker, ray
    "--internal", "--add-host", "--build-arg", "--temp-dir",
    # the classic distributed TensorFlow walk-through's own flags
    "--ps_hosts", "--worker_hosts", "--job_name", "--task_index",
}
# An inline span that starts with one of these is another program's command line.
OTHER_PROGRAMS = ("python", "pip", "podman", "docker", "kubectl", "ray", "srun", "sbatch", "unshare", "tc",
                  "ip", "git", "make", "helm", "pytest")


# --- pieces of a markdown document ----------------------------------------------------------

FENCE = re.compile(r"^(```|~~~)([^\n]*)\n(.*?)^\1[ \t]*$", re.S | re.M)
# A span may wrap onto the next line, never across a blank one.
INLINE = re.compile(r"(?<!`)`((?:[^`\n]|\n(?![ \t]*\n))+)`(?!`)")


# An indented block: lines of 4 or more leading spaces after a blank line, not in a list.
INDENTED = re.compile(r"(?<=\n\n)((?:(?: {4}|\t)(?![ \t]*[-*+] |[ \t]*\d+\. ).*(?:\n|$))+)")


def split_code(text: str) -> tuple[list[tuple[str, str]], str]:
    """(each code block's language and body, the prose with those blocks blanked)."""
    blocks = [(m.group(2).strip(), m.group(3)) for m in FENCE.finditer(text)]
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    blocks += [("", m.group(1)) for m in INDENTED.finditer(prose)]
    prose = INDENTED.sub(lambda m: "\n" * m.group(0).count("\n"), prose)
    return blocks, prose


def command_texts(text: str) -> list[str]:
    """Every line of a code block (continuations joined) and every inline code span."""
    blocks, prose = split_code(text)
    out = []
    for lang, body in blocks:
        if lang in ("python", "json", "yaml", "toml"):
            continue
        out += body.replace("\\\n", " ").splitlines()
    out += [" ".join(span.split()) for span in INLINE.findall(prose)]
    return out


# --- command lines --------------------------------------------------------------------------

PROGRAM = re.compile(
    r"(?:(?<=\s)|^|(?<=[=('\"]))"
    r"(?:(?:\S*/)?python3?\s+-m\s+(?P<module>[A-Za-z_][\w.]*)"
    r"|(?P<script>(?:[\w.-]*/)*(?:train|launch|bench)\.py|tfdist-(?:train|launch|bench)))"
    r"(?=\s|$|`)")
SHELL_STOP = {"|", "||", "&&", ";", "&", ">", ">>", "2>&1", ")", "<"}
PLACEHOLDER = re.compile(r"[<>…*{}$]|\.\.\.")


def _tokens(rest: str) -> list[str]:
    try:
        lexer = shlex.shlex(rest, posix=True, punctuation_chars="|&;<>()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words = list(lexer)
    except ValueError:  # an unbalanced quote in a shortened example: fall back to words
        words = rest.split("#")[0].split()
    out = []
    for word in words:
        if word in SHELL_STOP or word.startswith((">", "2>")):
            break
        out.append(word)
    return out


def _bad_flags(words: list[str], command: str) -> list[str]:
    known = flags_of(command)
    return [w.split("=")[0] for w in words
            if w.startswith("--") and len(w) > 2 and w.split("=")[0] not in known]


def _bad_files(words: list[str], doc: Path) -> list[str]:
    """The file a --program or a --task names must exist (a task may also be a built-in name)."""
    bad = []
    for flag, value in zip(words, words[1:]):
        if flag in ("--program", "--task") and value.endswith(".py") and not PLACEHOLDER.search(value):
            path = value.split(":")[0]
            if not (REPO / path).exists() and not (doc.parent / path).exists():
                bad.append(f"{flag} {value}")
    return bad


def check_commands(text: str, doc: Path = REPO / "README.md") -> list[str]:
    """Each command line's flags against its parser; each ``python -m`` target resolves."""
    problems = []
    for line in command_texts(text):
        for m in PROGRAM.finditer(line):
            words = _tokens(line[m.end():])
            if m.group("module"):
                module = m.group("module")
                if not module_resolves(module):
                    problems.append(f"python -m {module}: no such module (in: {line.strip()})")
                    continue
                command = MODULE_COMMANDS.get(module, module)
                if command not in PARSER_SOURCES:
                    continue
            else:
                command = SCRIPT_COMMANDS[Path(m.group("script")).name]
            own, after = words, []
            if command == "launch" and "--" in words:
                i = words.index("--")
                own, after = words[:i], words[i + 1:]
            for flag in _bad_flags(own, command):
                problems.append(f"{command}: no flag {flag} (in: {line.strip()})")
            if after and "--program" not in own:
                for flag in _bad_flags(after, "train"):
                    problems.append(f"train (after --): no flag {flag} (in: {line.strip()})")
            for named in _bad_files(own + after, doc):
                problems.append(f"{named}: no such file (in: {line.strip()})")
    return problems


@functools.lru_cache(maxsize=None)
def module_resolves(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_prose_flags(text: str) -> list[str]:
    """A flag named on its own in an inline span (`--flag ...`) must be one of ours (or listed)."""
    _, prose = split_code(text)
    known = all_flags() | OTHER_PROGRAMS_FLAGS
    problems = []
    for span in INLINE.findall(prose):
        span = " ".join(span.split())
        if PROGRAM.search(span) or span.split()[0] in OTHER_PROGRAMS:
            continue  # a whole command: check_commands reads ours against their own parsers
        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", span):
            if flag not in known:
                problems.append(f"no command has the flag {flag} (in: `{span}`)")
    return problems


# --- the Python API in the documents ------------------------------------------------------

def _api_keywords(name: str) -> tuple[set[str], bool]:
    """The keywords ``tfdist.<name>`` takes, and whether it takes more (``**options``)."""
    import inspect

    import tfdist

    params = inspect.signature(getattr(tfdist, name)).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def _option_names() -> set[str] | None:
    """The training options ``**options`` stands for, where the API says which they are."""
    from tfdist import api

    fields = getattr(api, "_train_config_fields", None)
    return set(fields()) if fields else None


def check_python_calls(text: str) -> list[str]:
    """Every keyword of a ``tfdist.fit(...)``/``tfdist.launch(...)`` in a python block exists."""
    import ast

    blocks, _ = split_code(text)
    problems = []
    for lang, body in blocks:
        if lang != "python":
            continue
        try:
            tree = ast.parse(body)
        except SyntaxError:
            continue  # a shortened example (`...` inside a call)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "tfdist"):
                continue
            import tfdist

            name = node.func.attr
            if not hasattr(tfdist, name):
                problems.append(f"tfdist.{name}: no such name in tfdist")
                continue
            try:
                named, more = _api_keywords(name)  # a function, or a typed group's class
            except (TypeError, ValueError):
                continue
            options = _option_names() if more else set()
            for kw in node.keywords:
                if kw.arg is None or kw.arg in named:
                    continue
                if more and (options is None or kw.arg in options):
                    continue
                problems.append(f"tfdist.{name}(): no keyword {kw.arg}")
    return problems


# --- links, anchors and file names ----------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    _, prose = split_code(text)
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(prose):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return out


def check_links(text: str, doc: Path) -> list[str]:
    """Every relative link's file exists, and its #anchor is a heading of the file it names."""
    _, prose = split_code(text)
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in anchors(text):
                problems.append(f"link to #{anchor}: no heading with that anchor here")
            continue
        file = (doc.parent / path).resolve()
        if not file.exists():
            problems.append(f"link to {target}: no file {file.relative_to(REPO) if file.is_relative_to(REPO) else file}")
            continue
        if anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            problems.append(f"link to {target}: no heading with the anchor #{anchor} in {file.name}")
    return problems


PATHLIKE = re.compile(r"^\.?[\w.-]+(?:/[\w.-]+)+/?$")
FILE_SUFFIXES = (".py", ".md", ".json", ".yaml", ".yml", ".sh", ".sbatch", ".png", ".toml",
                 ".lock", ".txt")
# Paths inside a run directory, placeholders, and other projects' source files.
NOT_REPO = ("runs/", "/", "~", "tmp/", "launch/", "path/to/", "tensorflow/", "keras/", "ray/")


def _missing(word: str, doc: Path) -> bool:
    word = word.rstrip(":,;.)").split(":")[0]
    if (not PATHLIKE.match(word) or word.startswith(NOT_REPO) or PLACEHOLDER.search(word)
            or not (word.endswith(FILE_SUFFIXES) or word.endswith("/"))):
        return False
    # Inside the package, docs may name a module from tfdist/ (`launcher/job.py`).
    return not any((base / word).exists() for base in (REPO, doc.parent, REPO / "tfdist"))


def check_file_names(text: str, doc: Path) -> list[str]:
    """A repository path in inline code (`tfdist/launcher/plan.py`) or in a shell block
    (`cat TF_CONFIG_examples/ps/chief-0.json`) names a file that exists."""
    blocks, prose = split_code(text)
    problems = []
    for span in INLINE.findall(prose):
        span = " ".join(span.split())
        problems += [f"no file {w.rstrip(':,;.)').split(':')[0]} (in: `{span}`)"
                     for w in span.split() if _missing(w, doc)]
    for lang, body in blocks:
        if lang in ("bash", "sh", "shell", "console", ""):
            for line in body.replace("\\\n", " ").splitlines():
                problems += [f"no file {w} (in: {line.strip()})"
                             for w in re.split(r"[\s\"'()=$]+", line) if _missing(w, doc)]
    return problems


# --- docs/reference.md's flag tables --------------------------------------------------------

REFERENCE = REPO / "docs" / "reference.md"
TABLES = {"train.py": "train", "launch.py": "launch", "bench.py": "bench",
          "tfdist.cli.tools.soak": "tfdist.cli.tools.soak"}
REGION = re.compile(r"(<!-- flags: (\S+) -->\n)(.*?)(<!-- /flags -->)", re.S)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def flag_table(name: str) -> str:
    """One table per argument group of the command's parser: flag, default, what it does."""
    p = parser(name)
    formatter = p._get_formatter()
    out = []
    for group in p._action_groups:
        rows = []
        for action in group._group_actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            if isinstance(action, argparse._HelpAction):
                continue
            flag = ", ".join(f"`{s}`" for s in action.option_strings)
            if action.choices:
                flag += " {" + ",".join(map(str, action.choices)) + "}"
            elif action.nargs != 0 and action.metavar:
                flag += f" {action.metavar}"
            if action.nargs == 0:
                default = ""
            elif action.default in (None, argparse.SUPPRESS, [], ()):
                default = "required" if action.required else ""
            else:
                default = f"`{action.default}`"
            meaning = formatter._expand_help(action) if action.help else ""
            meaning = re.sub(r"\s*\(default: [^()]*(?:\([^()]*\)[^()]*)*\)", "", meaning)
            rows.append(f"| {flag.replace('|', chr(92) + '|')} | {default} | {_cell(meaning)} |")
        if rows:
            title = group.title if group.title not in ("options", "optional arguments") else "general"
            out += [f"*{title}*", "", "| flag | default | what it does |", "|---|---|---|", *rows, ""]
    return "\n".join(out)


def reference_regions(text: str) -> dict[str, str]:
    return {m.group(2): m.group(3) for m in REGION.finditer(text)}


def write_reference() -> None:
    text = REFERENCE.read_text()
    text = REGION.sub(lambda m: m.group(1) + flag_table(TABLES[m.group(2)]) + m.group(4), text)
    REFERENCE.write_text(text)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_reference()
    else:
        print(__doc__)
