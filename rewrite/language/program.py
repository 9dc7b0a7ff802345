"""Loading a rule program: files, their imports, checking, and the ``Program`` value.

A program is one or more rule files plus everything they import. Loading reads
each file once (a file imported twice is shared, an import cycle is an error),
parses it, checks each file against the names it can see (its own declarations
and those of the files it imports, transitively) and checks the whole program for
duplicate and recursive names. All diagnostics of all files are collected; if there
is any, ``RuleError`` is raised with every one of them.

Example::

    >>> prog = load_program_text("rule mul_one: mul(x, 1) => x")
    >>> [r.name for r in prog.rules]
    ['mul_one']
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import attrs

from rewrite.language import ast
from rewrite.language.check import Scope, check_declarations, check_module, expand_families, run_only_once
from rewrite.language.diagnostics import Diagnostic, RuleError, did_you_mean, sort_diagnostics
from rewrite.language.params import binding_key, declared_params, instantiate, unbound_diagnostics
from rewrite.language.parser import parse_module
from rewrite.language.printer import format_expr

__all__ = ["Program", "load_program", "load_program_text"]


@attrs.frozen(eq=False)
class Program:
    """A checked rule program.

    Attributes:
        rules: every rule of the files and their imports; imported files first,
            then each file's rules in source order.
        families: family name -> its op names (as written; nested families expanded).
        rulesets: ruleset name -> its ``ast.Schedule``.
        files: the files read, in the same order as ``rules`` (imports first).
        sources: file path -> text, for printing diagnostics.
        unsettled: rules that rewrite their own output forever (E409), accepted
            because a ruleset runs them in ``once(...)``: never run to a fixpoint.
    """

    rules: tuple
    families: dict
    rulesets: dict
    files: tuple
    sources: dict = attrs.field(repr=False)
    unsettled: frozenset = frozenset()

    def rule(self, name: str) -> ast.Rule:
        """The rule called ``name``; KeyError if there is none."""
        for r in self.rules:
            if r.name == name:
                return r
        raise KeyError(f"no rule named {name!r}")


def load_program(paths: list) -> Program:
    """Load, check and combine rule files and their imports.

    Args:
        paths: rule file paths (``str`` or ``Path``); a single path is accepted too.
            Imports resolve relative to the importing file.

    Returns:
        The checked ``Program``.

    Raises:
        RuleError: with every diagnostic of every file (unreadable files, syntax
            errors, unknown names, ...).

    Example::

        prog = load_program(["rules/fusion.rw"])
        prog.rulesets["fusion"]
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    loader = _Loader()
    for p in paths:
        loader.load_file(Path(p), str(p), None)
    return loader.finish()


def read_rule_file(path: str) -> str:
    """The text of a rule file named on the command line (``rewrite fmt``);
    ``RuleError`` with the E402 diagnostic ``load`` gives when it cannot be read."""
    loader = _Loader()
    text = loader.read(Path(path), path)
    if text is None:
        raise RuleError(loader.diags, {})
    return text


def load_program_text(text: str, path: str = "<string>") -> Program:
    """Like ``load_program`` for rule text held in a string.

    Imports resolve relative to the directory of ``path``, or to the current
    directory when ``path`` is a placeholder such as ``"<string>"``.
    """
    loader = _Loader()
    base = Path.cwd() if path.startswith("<") else Path(path).parent
    loader.load_source(text, path, f"<text>{path}", base)
    return loader.finish()


@attrs.define
class _File:
    display: str  # the path shown in diagnostics
    key: str  # identity for sharing and cycle detection
    module: ast.Module | None = None
    imports: list = attrs.Factory(list)  # keys of imported files
    complete: bool = True  # every import was found and read
    # an instance of a parametrized file: the import that made it, and the names of
    # its declarations that depend on no parameter (the same in every instance)
    origin: ast.Import | None = None
    shared: frozenset = frozenset()
    uses: dict = attrs.Factory(dict)  # span of each parameter use -> its ast.Binding


def one_line_end(text: str) -> str:
    """Every line break as ``\\n``: CRLF, a lone CR (old Mac files) and the Unicode
    line and paragraph separators. The grammar ends lines at ``\\n`` only, and a
    terminal or editor that ends them elsewhere would show a file other than the one
    loaded (``rule evil ...\\r# disabled`` shows as a comment, and is a rule)."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if "\u2028" in text or "\u2029" in text or "\x85" in text:
        text = text.replace("\u2028", "\n").replace("\u2029", "\n").replace("\x85", "\n")
    return text


#: Files and instances one load may read: past it, an import is an E402.
MAX_LOADED_FILES = 1000

#: Imports nested deeper are refused (E402): the shipped files nest at most 2 levels.
MAX_IMPORT_DEPTH = 64
#: Larger rule files are refused before they are read (the shipped ones are under 50 KiB;
#: parsing costs about 100 bytes of memory per byte of a file of literals).
MAX_RULE_FILE_BYTES = 2**20
#: A rule file with more commas (arguments, list items: a literal list of millions of
#: ints parses for minutes) is refused before it is parsed.
MAX_RULE_FILE_ITEMS = 100_000


#: file systems whose files are no rule files: their reads may block (``/proc/kmsg``)
#: or hand out the process's secrets (``/proc/self/environ``)
_SPECIAL_ROOTS = ("/proc/", "/sys/")


def _not_a_rule_file(path: Path) -> str | None:
    """Why a named path is read as no rule file, or None. A symbolic link to a file
    not named ``*.rw`` (a repository may hold ``rules/x.rw -> ~/.git-credentials``:
    its first line would be quoted back in the syntax error), or anything on ``/proc``
    or ``/sys`` (``/dev``'s devices are no regular files: ``read`` says so). A path
    named without a link is the caller's choice."""
    try:
        resolved = os.path.realpath(path)
        linked = Path(path).is_symlink()  # the file itself (a folder's link is the caller's layout)
    except (OSError, ValueError):
        return None  # read() says what is wrong with it
    if resolved.startswith(_SPECIAL_ROOTS):
        return "a file of /proc or /sys, not a rule file"
    if linked and not resolved.endswith(".rw") and not os.path.isdir(resolved):
        return f"a symbolic link to '{resolved}', which is not a .rw rule file"
    return None


class _Loader:
    def __init__(self) -> None:
        self.files: dict = {}  # key -> _File
        self.order: list = []  # _File, imports before importers
        self.stack: list = []  # keys being loaded, for cycle detection
        self.diags: list = []
        self.sources: dict = {}

    def load_file(self, path: Path, display: str, import_span: ast.Span | None,
                  imp: ast.Import | None = None) -> str | None:
        """Read and load one file (an instance of it, for an import with bindings);
        the key of the file, or None if unreadable."""
        try:
            key = os.path.realpath(path)
            os.fsencode(key)
        except (ValueError, OSError, UnicodeError) as exc:  # NUL bytes, names too long, lone surrogates
            printable = "".join(c if c.isprintable() else repr(c)[1:-1] for c in display)
            self._unreadable(printable, import_span, f"not a usable path ({type(exc).__name__})")
            return None
        if imp is not None and imp.bindings:
            key = f"{key}?{binding_key(imp.bindings)}"
        if key in self.files:
            return key
        if len(self.files) >= MAX_LOADED_FILES:
            self._unreadable(display, import_span, f"one load reads at most {MAX_LOADED_FILES} rule files and "
                                                   "parametrized instances of them (imports that bind a parameter "
                                                   "anew at every level double them)")
            return None
        text = self.read(path, display, import_span)
        if text is None:
            return None
        self.load_source(text, display, key, path.parent, imp)
        return key

    def read(self, path: Path, display: str, import_span: ast.Span | None = None) -> str | None:
        """The file's text, or None with an E402 diagnostic (unreadable, not a regular
        file, too large, not UTF-8). A FIFO would block the read, /dev/zero never end it."""
        problem = _not_a_rule_file(path)
        if problem is not None:
            self._unreadable(display, import_span, problem)
            return None
        try:
            status = os.stat(path)
            if not stat.S_ISREG(status.st_mode) and not stat.S_ISDIR(status.st_mode):  # a folder: named below
                self._unreadable(display, import_span, "not a regular file (a pipe, a device or a socket)")
                return None
            if status.st_size > MAX_RULE_FILE_BYTES:
                self._unreadable(display, import_span, f"{status.st_size} bytes: a rule file is at most "
                                                       f"{MAX_RULE_FILE_BYTES // 2**20} MiB")
                return None
            raw = path.read_bytes()
            return raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            line, col = utf8_error_position(raw, exc)
            at = ast.Span(display, line, col, line, col + 1) if import_span is None else import_span
            self._unreadable(display, at, f"not valid UTF-8 at line {line}, column {col} (byte {exc.start})",
                             imported=import_span is not None)
        except OSError as exc:
            self._unreadable(display, import_span, exc.strerror or str(exc), path)
        return None

    def _unreadable(self, display: str, span: ast.Span | None, why: str, path: Path | None = None,
                    imported: bool | None = None) -> None:
        hint = None
        try:  # the path may be one the system refuses to even look at (a name over 255 bytes)
            if path is not None and path.is_dir():
                hint = f"{path} is a folder: name the .rw files in it ({path}/*.rw)"
            elif path is not None:
                found = list(path.parent.glob("*.rw")) if path.parent.is_dir() else ()
                hint = did_you_mean(path.name, (p.name for p in found if p.name != path.name)) \
                    or f"looked for {path}"
        except OSError:
            hint = None
        if imported is None:
            imported = span is not None
        if not imported:
            span = span or ast.Span(display, 1, 1, 1, 1)
            self.diags.append(Diagnostic(span, f"cannot read rule file '{display}': {why}", "E402", help=hint))
        else:
            self.diags.append(Diagnostic(span, f"cannot import '{display}': {why}", "E402", help=hint))

    def load_source(self, text: str, display: str, key: str, base: Path, imp: ast.Import | None = None) -> None:
        text = one_line_end(text)
        f = _File(display, key)
        self.files[key] = f
        items = text.count(",")
        if len(text) > MAX_RULE_FILE_BYTES or items > MAX_RULE_FILE_ITEMS:
            f.complete = False
            self._unreadable(display, imp.span if imp is not None else None,
                             f"{len(text)} characters: a rule file is at most {MAX_RULE_FILE_BYTES // 2**20} MiB"
                             if len(text) > MAX_RULE_FILE_BYTES else
                             f"{items} commas: a rule file lists at most {MAX_RULE_FILE_ITEMS} arguments and items")
            return
        self.sources[display] = text
        module, diags = parse_module(text, display)
        self.diags += diags
        if module is not None and (declared_params(module) or (imp is not None and imp.bindings)):
            if imp is None:
                self.diags += unbound_diagnostics(module, display)
                module = None
            else:
                instance = instantiate(module, imp.bindings, imp.path, imp.span)
                f.origin, f.shared, f.uses = imp, instance.shared, instance.uses
                self.diags += instance.diagnostics
                module = None if instance.diagnostics else instance.module
        f.module = module
        if module is not None:
            self.stack.append(key)
            for item in module.items:
                if isinstance(item, ast.Import):
                    self._import(f, item, base)
            self.stack.pop()
        self.order.append(f)

    def _import(self, f: _File, imp: ast.Import, base: Path) -> None:
        display = imp.path
        try:
            target = base / imp.path
            display = os.path.normpath(os.path.join(
                os.path.dirname(f.display) if not f.display.startswith("<") else "", imp.path))
            key = os.path.realpath(target)
            exists, is_dir = target.is_file(), target.is_dir()
            os.fsencode(key)
        except (ValueError, OSError, UnicodeError) as exc:  # NUL bytes, names too long, lone surrogates
            self.diags.append(Diagnostic(imp.span, f"cannot import {display!r}: not a usable path "
                                                   f"({type(exc).__name__})", "E402",
                                         help="imports name rule files, e.g. import \"cleanup.rw\""))
            f.complete = False
            return
        loading = [k.split("?")[0] for k in self.stack]  # an instance is its file
        if key in loading:
            chain = [self.files[k].display for k in self.stack[loading.index(key):]] + [display]
            self.diags.append(Diagnostic(imp.span, f"import cycle: {' -> '.join(chain)}", "E403",
                                         help="move the shared declarations into a file both can import"))
            return
        if target.suffix != ".rw" or not key.endswith(".rw"):
            # (checked on the resolved path too: a symlink named *.rw may point anywhere)
            # Only rule files: an import must not read (and quote back) any other file.
            self.diags.append(Diagnostic(imp.span, f"cannot import '{display}': not a .rw rule file", "E402",
                                         help="imports name rule files, e.g. import \"cleanup.rw\""))
            f.complete = False
            return
        if not exists:
            why = ("is a directory" if is_dir else
                   "not a regular file (a pipe, a device or a socket)" if os.path.exists(target) else
                   "is a symbolic link to nothing (a loop, or a missing target)" if target.is_symlink() else
                   "no such file")
            self._unreadable(display, imp.span, why, target)
            f.complete = False
            return
        if len(self.stack) >= MAX_IMPORT_DEPTH and key not in self.files:
            self._unreadable(display, imp.span, f"imports nested more than {MAX_IMPORT_DEPTH} levels deep "
                                                f"({self.files[self.stack[0]].display} imports a file that imports "
                                                "a file ...)")
            f.complete = False
            return
        loaded = self.load_file(target, display, imp.span, imp)
        if loaded is None:
            f.complete = False
        else:
            f.imports.append(loaded)

    # ------------------------------------------------------------ checking

    def _closure(self, f: _File) -> list:
        seen, todo, out = {f.key}, [f], []
        while todo:
            cur = todo.pop()
            out.append(cur)
            for k in cur.imports:
                if k not in seen:
                    seen.add(k)
                    todo.append(self.files[k])
        return out

    def _scope(self, f: _File) -> Scope:
        files = self._closure(f)
        families, schedulables = {}, {}
        for g in files:
            for item in g.module.items if g.module is not None else ():
                if isinstance(item, ast.Family):
                    families.setdefault(item.name, item)
                elif isinstance(item, (ast.Rule, ast.RuleSetDecl)):
                    schedulables.setdefault(item.name, item)
        complete = all(g.module is not None and g.complete for g in files)
        return Scope(families, schedulables, complete, f.uses)

    def _unique(self) -> list:
        """``(file, module)`` of every loaded file, a declaration shared by several
        instances of one parametrized file (it depends on no parameter) kept in the
        first only: like a file imported twice, it is one declaration."""
        seen: set = set()
        out = []
        for f in self.order:
            module = f.module
            if module is None:
                continue
            if f.shared:
                items = []
                for item in module.items:
                    if getattr(item, "name", None) in f.shared:
                        where = item.span
                        key = (f.key.split("?")[0], item.name, where and (where.line, where.col))
                        if key in seen:
                            continue
                        seen.add(key)
                    items.append(item)
                module = attrs.evolve(module, items=tuple(items))
            out.append((f, module))
        return out

    def finish(self) -> Program:
        unique = self._unique()
        modules = [m for _, m in unique]
        diags = list(self.diags)
        checking = None
        unsettled: set = set()
        once, repeated = run_only_once(modules)  # E409's exemption: how the whole program runs a rule
        try:
            for f, module in unique:
                checking = f
                endless: list = []
                found = check_module(module, self._scope(f), endless)
                found += [_repeated_here(diag, repeated.get(name)) for name, diag in endless if name not in once]
                unsettled.update(name for name, _ in endless if name in once)
                if f.origin is not None:  # where the instance comes from, for what is not at the import itself
                    note = _instance_note(f.origin)
                    here = f.origin.span.path if f.origin.span is not None else None
                    found = [d if d.span is not None and d.span.path == here else
                             attrs.evolve(d, related=d.related + (note,)) for d in found]
                diags += found
            diags += check_declarations(modules, [f.origin and _instance_note(f.origin) for f, _ in unique])
        except RecursionError:
            where = ast.Span(checking.display, 1, 1, 1, 1) if checking is not None else None
            diags.append(Diagnostic(where, "declarations nested too deeply to check (a family or rule set "
                                           "defined through hundreds of others)", "E001",
                                    help="define the family or rule set from its members directly"))
        if diags:
            raise RuleError(sort_diagnostics(diags, [f.display for f in self.order]), self.sources)
        items = [i for m in modules for i in m.items]
        families = {i.name: i for i in items if isinstance(i, ast.Family)}
        return Program(
            rules=tuple(i for i in items if isinstance(i, ast.Rule)),
            families=expand_families(families),
            rulesets={i.name: i.schedule for i in items if isinstance(i, ast.RuleSetDecl)},
            files=tuple(f.display for f in self.order),
            sources=dict(self.sources),
            unsettled=frozenset(unsettled),
        )


def _repeated_here(diag: Diagnostic, where: ast.Span | None) -> Diagnostic:
    """An E409 with a note at the schedule that repeats the rule, when that is
    not in the rule's own file (an importer's ``fixpoint(grow)``)."""
    if where is None or diag.span is None or where.path == diag.span.path:
        return diag
    return attrs.evolve(diag, related=diag.related + ((where, "run to a fixpoint here"),))


def _instance_note(imp: ast.Import) -> tuple:
    """A ``note:`` for a diagnostic in an instance of a parametrized file: the
    import that made it, with its bindings."""
    bound = ", ".join(f"{b.name} = {format_expr(b.value)}" + (f" as {b.tag}" if b.tag else "") for b in imp.bindings)
    return (imp.span, f"in the instance of '{imp.path}' imported here with {bound}")


def utf8_error_position(raw: bytes, exc: UnicodeDecodeError) -> tuple:
    """(line, column), 1-based, of the byte a UTF-8 decode of ``raw`` failed at; the
    column counts the characters before it on its line."""
    start = exc.start + (3 if raw.startswith(b"\xef\xbb\xbf") and exc.object is not raw else 0)
    line_start = raw.rfind(b"\n", 0, start) + 1
    return raw.count(b"\n", 0, start) + 1, len(raw[line_start:start].decode("utf-8", "replace")) + 1
