"""Command policy of the terminal env: lex a shell-like command line, check it against an allowlist, plan its argv.

No shell ever runs. A command line is lexed here with POSIX quoting (single quotes, double quotes, backslash; the
same words as ``shlex.split`` for operator-free input, which the tests check) into words and the only operators
supported: ``|`` (one pipeline), ``&&`` (chains), ``>``, ``>>`` (output to a file) and ``<`` (input from a file).
Everything else a shell would interpret is refused with a message that says what to use instead: ``;``, ``||``,
``&``, backticks, ``$(...)``, ``$VAR``, ``<(...)``, ``2>``, subshells, comments, newlines.

Each stage's program must be in ``SPECS`` (a small allowlist of coreutils/grep/sed/find) and may use only the short
options listed there; options that could reach outside the sandbox, follow symlinks, run programs or make output
time-dependent (``find -exec``, ``grep -R``, ``ls -l``, ``sort -R``, ``cp -L``, ``sed -f`` ...) are not listed.
Every argument that names a file goes through a ``PathResolver`` (``terminal_fs.SandboxPaths`` against a real
sandbox: realpath inside the root, ``ln -s`` targets too; ``DryPaths`` for the static check before anything runs).
Pure module: no subprocesses or file access (terminal_sandbox.py runs the plan).
"""
from __future__ import annotations

import glob as globlib
from dataclasses import dataclass
from typing import Protocol

VIRTUAL_ROOT = "/sandbox"  # what the agent sees as the sandbox's absolute path (pwd, cd /sandbox)
BUILTINS = ("cd", "pwd")  # handled by the env, never executed


class PolicyError(Exception):
    """A command refused by the policy; the message is the agent's observation."""


@dataclass(frozen=True)
class Word:
    """One lexed word: its text after quote removal, and its glob pattern if it had unquoted ``* ? [``."""

    text: str
    pattern: str | None = None


@dataclass(frozen=True)
class Spec:
    """What a program may be given: short options without/with a value, and what its operands are."""

    flags: str = ""
    valued: str = ""
    operands: str = "paths"  # "paths" | "text" | "raw" (no option parsing) | "first_text" (pattern/script + paths)
    writes: bool = False  # changes files, so it must run alone (not inside a pipeline)
    digits: bool = False  # accepts -N (head -5)
    path_valued: str = ""  # valued options whose value is a path (sort -o FILE)
    writes_with: str = ""  # options that make it write files (sed -i, sort -o)
    inject: tuple[str, ...] = ()  # options always added (sed --sandbox: no e/r/w commands)


SPECS: dict[str, Spec] = {
    "ls": Spec("aA1RFprSd"), "cat": Spec("nbsEATv"), "tac": Spec(), "wc": Spec("lwcmL"),
    "head": Spec("qv", "nc", digits=True), "tail": Spec("qv", "nc", digits=True),
    "sort": Spec("rnufbdiVgMhsc", "kto", inject=("--parallel=1",), path_valued="o", writes_with="o"),
    "uniq": Spec("cdui", "fsw"),
    "grep": Spec("civnlLwxoEFrhHqs", "emABC", operands="first_text"),
    "sed": Spec("nEri", "e", operands="first_text", inject=("--sandbox",), writes_with="i"),
    "cut": Spec("sn", "dfcb"), "tr": Spec("dscC", operands="text"), "paste": Spec("s", "d"), "comm": Spec("123"),
    "diff": Spec("qiwbB"), "echo": Spec(operands="raw"), "printf": Spec(operands="raw"),
    "seq": Spec("w", "s", operands="text"), "basename": Spec(operands="text"), "dirname": Spec(operands="text"),
    "sleep": Spec(operands="text"), "yes": Spec(operands="raw"), "true": Spec(operands="raw"),
    "false": Spec(operands="raw"),
    "mkdir": Spec("pv", writes=True), "touch": Spec("cam", writes=True), "cp": Spec("rRfnvpaT", writes=True),
    "mv": Spec("fnvT", writes=True), "rm": Spec("rRfvd", writes=True), "ln": Spec("sfnv", writes=True),
    "find": Spec(operands="find"), "test": Spec(operands="test"), "[": Spec(operands="test"),
}
FIND_NOARG = ("-print", "-print0", "-empty", "-delete", "-not", "!", "-a", "-o", "-and", "-or", "(", ")", "-true",
              "-false", "-depth", "-prune")
FIND_ARG = ("-name", "-iname", "-path", "-ipath", "-type", "-maxdepth", "-mindepth", "-size", "-regex", "-iregex")
TEST_FILE_OPS = ("-e", "-f", "-d", "-s", "-r", "-w", "-x", "-L", "-h")  # the next word is a path
TEST_OPS = TEST_FILE_OPS + ("-n", "-z", "-eq", "-ne", "-lt", "-le", "-gt", "-ge", "-a", "-o")
MAX_COMMAND_CHARS = 2000
_REFUSED_CHARS = {";": "';' is not supported: chain commands with &&", "(": "subshells '( )' are not supported",
                  ")": "subshells '( )' are not supported", "`": "command substitution (backticks) is not supported"}


# ----------------------------------------------------------------------------------------------------- lexing
def _dollar_refused(command: str, j: int, in_double: bool) -> bool:
    """Whether the ``$`` at ``j`` would expand in bash (variable, substitution, ANSI quoting); a lone ``$`` is text."""
    nxt = command[j + 1] if j + 1 < len(command) else ""
    return bool(nxt) and (nxt.isalnum() or nxt in "_({?!#@*-$" or (not in_double and nxt in "'\""))


def lex(command: str) -> list[Word | str]:
    """Words and operators (``| && > >> <``) of a command line; PolicyError on anything a shell would expand."""
    if len(command) > MAX_COMMAND_CHARS:
        raise PolicyError(f"command longer than {MAX_COMMAND_CHARS} characters: split it into steps")
    if "\n" in command or "\r" in command:
        raise PolicyError("one command per step: newlines are not supported")
    if any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in command):
        raise PolicyError("control characters are not supported")
    tokens: list[Word | str] = []
    text: list[str] = []
    pattern: list[str] = []
    state = {"word": False, "quoted": False, "glob": False}

    def add(chars: str, quoted: bool) -> None:
        text.append(chars)
        pattern.append(globlib.escape(chars) if quoted else chars)
        state["word"] = True
        state["quoted"] = state["quoted"] or quoted
        state["glob"] = state["glob"] or (not quoted and any(c in "*?[" for c in chars))

    def flush() -> None:
        if state["word"]:
            tokens.append(Word("".join(text), "".join(pattern) if state["glob"] else None))
        text.clear()
        pattern.clear()
        state.update(word=False, quoted=False, glob=False)

    i, n = 0, len(command)
    while i < n:
        c = command[i]
        nxt = command[i + 1] if i + 1 < n else ""
        if c in " \t":
            flush()
        elif c == "'":
            end = command.find("'", i + 1)
            if end < 0:
                raise PolicyError("unterminated single quote: close it with '")
            add(command[i + 1:end], quoted=True)
            i = end
        elif c == '"':
            j, chars = i + 1, []
            while j < n and command[j] != '"':
                d = command[j]
                if d == "`" or (d == "$" and _dollar_refused(command, j, in_double=True)):
                    raise PolicyError("variables and command substitution ($, `) are not supported; "
                                      "use single quotes for a literal $")
                if d == "\\" and j + 1 < n and command[j + 1] in '"\\$`':
                    j += 1
                chars.append(command[j])
                j += 1
            if j >= n:
                raise PolicyError('unterminated double quote: close it with "')
            add("".join(chars), quoted=True)
            i = j
        elif c == "\\":
            if not nxt or nxt in "\n\r":
                raise PolicyError("a trailing backslash is not supported: one command per step")
            add(nxt, quoted=True)
            i += 1
        elif c == "|":
            if nxt == "|":
                raise PolicyError("'||' is not supported: use && chains or separate steps")
            flush()
            tokens.append("|")
        elif c == "&":
            if nxt != "&":
                raise PolicyError("background jobs '&' are not supported; chain commands with &&")
            flush()
            tokens.append("&&")
            i += 1
        elif c in "<>":
            if state["word"] and not state["quoted"] and "".join(text).isdigit():
                raise PolicyError("file-descriptor redirections like 2> are not supported; stderr is always shown")
            flush()
            op = ">>" if c == ">" and nxt == ">" else c
            i += len(op) - 1
            after = command[i + 1] if i + 1 < n else ""
            if after in ("&", "(", "|", "<", ">"):
                raise PolicyError(f"'{op}{after}' is not supported: only > file, >> file and < file redirections")
            tokens.append(op)
        elif c in _REFUSED_CHARS:
            raise PolicyError(_REFUSED_CHARS[c])
        elif c == "$" and _dollar_refused(command, i, in_double=False):
            raise PolicyError("variables and command substitution ($VAR, $(...)) are not supported")
        elif c == "#" and not state["word"]:
            raise PolicyError("comments (#) are not supported")
        else:
            add(c, quoted=False)
        i += 1
    flush()
    return tokens


# ----------------------------------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class Segment:
    """One pipeline of a ``&&`` chain: its stages (words, program first) and its redirections."""

    stages: tuple[tuple[Word, ...], ...]
    stdin: Word | None = None
    stdout: Word | None = None
    append: bool = False


def parse(command: str) -> list[Segment]:
    """The ``&&`` chain of pipelines in ``command``; PolicyError for syntax the sandbox does not support."""
    if not isinstance(command, str) or not command.strip():
        raise PolicyError("empty command: type a shell command, or submit when done")
    chain: list[list[Word | str]] = [[]]
    for tok in lex(command):
        if tok == "&&":
            chain.append([])
        else:
            chain[-1].append(tok)
    segments = [_parse_pipeline(part) for part in chain]
    for seg in segments:
        validate_segment(seg)
    return segments


def _parse_pipeline(part: list[Word | str]) -> Segment:
    stages: list[list[Word]] = [[]]
    stdin = stdout = None
    append = False
    toks = iter(part)
    for tok in toks:
        if tok == "|":
            if stdout is not None:
                raise PolicyError("'>' is only allowed on the last command of a pipeline")
            stages.append([])
        elif tok in ("<", ">", ">>"):
            target = next(toks, None)
            if not isinstance(target, Word):
                raise PolicyError(f"'{tok}' needs a file name after it")
            if tok == "<":
                if stdin is not None or len(stages) > 1:
                    raise PolicyError("'<' is allowed once, on the first command of a pipeline")
                stdin = target
            else:
                if stdout is not None:
                    raise PolicyError("only one output redirection per pipeline")
                stdout, append = target, tok == ">>"
        else:
            stages[-1].append(tok)
    if any(not s for s in stages):
        raise PolicyError("empty command around | or &&: write a command on each side")
    return Segment(tuple(tuple(s) for s in stages), stdin, stdout, append)


def validate_segment(seg: Segment) -> None:
    """Static checks (no files): allowlisted programs, options, builtins alone, writers not inside pipelines."""
    for stage in seg.stages:
        words = [w.text for w in stage]
        if words[0] in BUILTINS:
            if len(seg.stages) > 1 or seg.stdin or seg.stdout:
                raise PolicyError(f"{words[0]} must be used alone (no pipes or redirections)")
            continue
        planned = plan_stage(words, DryPaths())
        if planned.writes and len(seg.stages) > 1:
            raise PolicyError(f"{words[0]} changes files, so it cannot be part of a pipeline; "
                              f"run it as its own command (or chain with &&)")


# ----------------------------------------------------------------------------------------------------- planning
class PathResolver(Protocol):
    """Checks a path-like argument and returns the text to pass to the program (raises PolicyError if outside)."""

    def path(self, arg: str, *, allow_root: bool = True) -> str: ...

    def symlink(self, target: str, link: str, *, no_dereference: bool = False) -> None: ...


class DryPaths:
    """Static validation: paths are passed through unchecked (SandboxPaths checks them before the command runs)."""

    def path(self, arg: str, *, allow_root: bool = True) -> str:
        return arg

    def symlink(self, target: str, link: str, *, no_dereference: bool = False) -> None:
        return None


@dataclass(frozen=True)
class PlannedStage:
    """argv of one stage (program name first; the runner maps it to /usr/bin or /bin) and whether it writes."""

    argv: tuple[str, ...]
    writes: bool


def _split_options(prog: str, spec: Spec, words: list[str],
                   paths: PathResolver) -> tuple[list[str], list[str], set[str]]:
    """GNU-style options anywhere before ``--``: (normalized options, operands, option letters seen).

    Valued options are re-emitted as ``-X VALUE`` (a path value checked by ``paths``), so what runs is what we checked.
    """
    opts: list[str] = []
    operands: list[str] = []
    seen: set[str] = set()
    i, ended = 0, False
    while i < len(words):
        w = words[i]
        i += 1
        if ended or w == "-" or not w.startswith("-"):
            operands.append(w)
        elif w == "--":
            ended = True
        elif w.startswith("--"):
            raise PolicyError(f"{prog}: long option {w} is not allowed; allowed options: {_allowed(spec)}")
        elif spec.digits and w[1:].isdigit():
            opts.append(w)
        else:
            letters = ""
            for k, ch in enumerate(w[1:], start=1):
                seen.add(ch)
                if ch in spec.flags:
                    if prog == "sed" and ch == "i" and k != len(w) - 1:
                        raise PolicyError("sed: -i takes no backup suffix here; write -i on its own")
                    letters += ch
                    continue
                if ch not in spec.valued:
                    raise PolicyError(f"{prog}: option -{ch} is not allowed; allowed options: {_allowed(spec)}")
                value = w[k + 1:]
                if not value:
                    if i >= len(words):
                        raise PolicyError(f"{prog}: option -{ch} needs a value")
                    value, i = words[i], i + 1
                if letters:
                    opts.append("-" + letters)
                    letters = ""
                opts += [f"-{ch}", paths.path(value) if ch in spec.path_valued else value]
                break
            if letters:
                opts.append("-" + letters)
    return opts, operands, seen


def _allowed(spec: Spec) -> str:
    shown = " ".join(f"-{c}" for c in spec.flags) + "".join(f" -{c} VALUE" for c in spec.valued)
    return shown.strip() or "none"


def plan_stage(words: list[str], paths: PathResolver) -> PlannedStage:
    """Check one stage against the allowlist and resolve its paths; PolicyError says what is not allowed."""
    prog, args = words[0], words[1:]
    if prog not in SPECS:
        raise PolicyError(f"command {prog!r} is not available; allowed commands: {' '.join(sorted(SPECS))}, "
                          f"cd, pwd, and submit when done")
    spec = SPECS[prog]
    if spec.operands == "raw":
        return PlannedStage((prog, *args), spec.writes)
    if spec.operands == "find":
        return _plan_find(args, paths)
    if spec.operands == "test":
        return _plan_test(prog, args, paths)
    opts, operands, seen = _split_options(prog, spec, args, paths)
    writes = spec.writes or bool(seen & set(spec.writes_with)) or (prog == "uniq" and len(operands) >= 2)
    head: list[str] = []
    if spec.operands == "first_text" and "e" not in seen:
        if not operands:
            raise PolicyError(f"{prog}: missing the {'pattern' if prog == 'grep' else 'script'} operand")
        head, operands = operands[:1], operands[1:]
    if spec.operands == "text":
        checked = operands
    elif prog == "ln":
        checked = _plan_ln(seen, operands, paths)
    else:
        checked = [o if o == "-" else paths.path(o, allow_root=prog not in ("rm", "mv")) for o in operands]
    return PlannedStage((prog, *spec.inject, *opts, "--", *head, *checked) if opts or head or checked
                        else (prog, *spec.inject), writes)


def _plan_ln(letters: set[str], operands: list[str], paths: PathResolver) -> list[str]:
    if len(operands) != 2:
        raise PolicyError("ln: give exactly two operands: ln [-s] TARGET LINK_NAME")
    target, link = operands
    if "s" in letters:
        paths.symlink(target, link, no_dereference="n" in letters)
        return [target, paths.path(link)]
    return [paths.path(target), paths.path(link)]


def _plan_find(args: list[str], paths: PathResolver) -> PlannedStage:
    i = 1 if args[:1] == ["-P"] else 0
    roots = []
    while i < len(args) and not args[i].startswith("-") and args[i] not in ("(", ")", "!"):
        roots.append(paths.path(args[i]))
        i += 1
    expr = args[i:]
    j = 0
    while j < len(expr):
        if expr[j] in FIND_ARG:
            if j + 1 >= len(expr):
                raise PolicyError(f"find: {expr[j]} needs a value")
            j += 2
        elif expr[j] in FIND_NOARG:
            j += 1
        else:
            raise PolicyError(f"find: {expr[j]!r} is not allowed; allowed: {' '.join(FIND_ARG + FIND_NOARG)}")
    return PlannedStage(("find", *args[:1 if args[:1] == ["-P"] else 0], *roots, *expr), "-delete" in expr)


def _plan_test(prog: str, args: list[str], paths: PathResolver) -> PlannedStage:
    if prog == "[" and args[-1:] != ["]"]:
        raise PolicyError("[: missing the closing ]")
    out = list(args)
    for k, word in enumerate(out):
        if word.startswith("-") and word not in TEST_OPS:  # -nt/-ef/-b ... would stat unchecked paths
            raise PolicyError(f"{prog}: operator {word} is not allowed; allowed: {' '.join(TEST_OPS)} = != !")
        if word in TEST_FILE_OPS and k + 1 < len(out):
            out[k + 1] = paths.path(out[k + 1])
    return PlannedStage((prog, *out), False)
