"""Lark parse errors -> friendly syntax diagnostics (codes E001-E008).

Lark reports "unexpected token X, expected one of {...}" in terms of grammar
terminals. Users make a handful of typical mistakes (a missing ``=>``, an unclosed
parenthesis, ``=`` for ``==``, a missing ``:`` after the rule name, an unterminated
string), so each is recognised from the failing token, the terminals the parser
expected there and the brackets still open, and named in the user's terms.
"""

from __future__ import annotations

import functools
import unicodedata

import lark
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken
from lark.lexer import PatternStr

from rewrite.language.ast import Span
from rewrite.language.diagnostics import Diagnostic, did_you_mean

__all__ = ["NOT_LITERALS", "syntax_diagnostic"]

_DESCRIBE = {"NAME": "a name", "INT": "an integer", "FLOAT": "a number",
             "STRING": "a string", "ELLIPSIS": "'...'", "$END": "end of file"}
_DECL_KEYWORDS = ("rule", "family", "ruleset", "import", "param")
_CLOSER = {"(": ")", "[": "]"}
# When one of these is expected, list only them: they are what the user most
# likely forgot, and the full set (every operator that could continue an
# expression) is noise.
_SALIENT = (")", "]", ",", ":", "=>")
# After these tokens a rule needs more: what, in the user's words.
_NEEDS = {"=>": "a replacement", "where": "a condition", ":": "a pattern", "=": "a value",
          "and": "a condition", "or": "a condition", "not": "a condition"}
#: the hint for inf and nan in a rule, which are not literals
NOT_LITERALS = ("'inf' and 'nan' are not literals: write a number (a large finite one for a bound), "
                "or leave the argument out where the op takes None")
_RULE_SHAPE = "a rule reads: rule NAME: PATTERN [where CONDITION] => REPLACEMENT"


@functools.lru_cache(maxsize=4)
def _terminals(parser: lark.Lark) -> dict:
    """Terminal name -> its literal text, for string terminals (``RPAR`` -> ``)``)."""
    return {t.name: t.pattern.value for t in parser.terminals if isinstance(t.pattern, PatternStr)}


def syntax_diagnostic(exc: Exception, text: str, path: str, parser: lark.Lark) -> Diagnostic:
    """The diagnostic for a Lark parse error on ``text``."""
    if isinstance(exc, UnexpectedCharacters):
        return _bad_character(exc, text, path)
    if isinstance(exc, UnexpectedToken):
        return _bad_token(exc, text, path, parser)
    line = getattr(exc, "line", None) if isinstance(exc, UnexpectedInput) else None
    col = getattr(exc, "column", None) if isinstance(exc, UnexpectedInput) else None
    line, col = (line if isinstance(line, int) and line > 0 else 1), (col if isinstance(col, int) and col > 0 else 1)
    return Diagnostic(Span(path, line, col, line, col + 1), "syntax error", "E001")


def _bad_character(exc: UnexpectedCharacters, text: str, path: str) -> Diagnostic:
    pos, line, col = exc.pos_in_stream, exc.line, exc.column
    ch = text[pos] if 0 <= pos < len(text) else ""
    rest_of_line = text[pos:].split("\n", 1)[0]
    span = Span(path, line, col, line, col + 1)
    if ch in "\"'":
        return Diagnostic(Span(path, line, col, line, col + len(rest_of_line)), "unterminated string", "E003",
                          help=f"close the string with {ch} on the same line")
    if rest_of_line.startswith("->"):
        return Diagnostic(Span(path, line, col, line, col + 2), "expected '=>', found '->'", "E007",
                          help="the pattern and the replacement are separated by '=>'")
    hints = {"&": "write 'and' to combine conditions", "!": "write 'not' to negate a condition",
             "-": "a minus sign is only allowed on a number literal"}
    if ch == "-" and rest_of_line[1:].lstrip().startswith(("inf", "nan")):
        hints["-"] = NOT_LITERALS
    return Diagnostic(span, f"unexpected character {_char(ch)}", "E002", help=hints.get(ch))


def _char(ch: str) -> str:
    if ch == "":
        return "end of file"
    if ch == "'":
        return '"\'"'
    if not ch.isprintable():
        return f"U+{ord(ch):04X}"
    if ch.isascii():
        return f"'{ch}'"
    # a letter from another script may look exactly like an ASCII one: name it
    return f"'{ch}' (U+{ord(ch):04X} {unicodedata.name(ch, 'unnamed')})"


class _Context:
    """What the tokens before the error say: open brackets and whether the error is
    inside a where clause."""

    def __init__(self, parser: lark.Lark, text: str, stop: int):
        self.open: list = []  # (char, Token)
        self.in_where = False
        self.in_replacement = False  # after a rule's '=>'
        self.rule_name: str | None = None
        self.last: str | None = None  # the text of the last token before the error
        previous = None
        try:
            for tok in parser.lex(text):
                if tok.start_pos >= stop:
                    break
                if tok.type == "RULE":
                    self.in_where, self.in_replacement, self.rule_name = False, False, None
                elif previous is not None and previous.type == "RULE" and tok.type == "NAME":
                    self.rule_name = str(tok)
                elif tok.type == "WHERE":
                    self.in_where = True
                elif str(tok) == "=>":
                    self.in_where, self.in_replacement = False, True
                if str(tok) in _CLOSER:
                    self.open.append((str(tok), tok))
                elif str(tok) in (")", "]") and self.open:
                    self.open.pop()
                previous = tok
                self.last = str(tok)
        except lark.exceptions.LarkError:
            pass  # lexing only failed past the error position; what we have is right


def _bad_token(exc: UnexpectedToken, text: str, path: str, parser: lark.Lark) -> Diagnostic:
    tok = exc.token
    terms = _terminals(parser)
    expected = {terms.get(name, name) for name in (exc.accepts or exc.expected)}
    found_text = terms.get(tok.type, str(tok))
    at_end = tok.type == "$END"
    if at_end:
        line, col = _end_position(text)
        span, stop = Span(path, line, col, line, col + 1), len(text)
    else:
        span = Span(path, tok.line, tok.column, tok.end_line, tok.end_column)
        stop = tok.start_pos
    found = "end of file" if at_end else f"'{tok}'"
    ctx = _Context(parser, text, stop)
    where = f"{span.line}:{span.col}"

    if found_text in (")", "]") and found_text not in expected:
        if not ctx.open:
            return Diagnostic(span, f"unmatched '{found_text}'", "E005",
                              help=f"remove it, or add the '{'(' if found_text == ')' else '['}' it closes")
        opener, otok = ctx.open[-1]
        return Diagnostic(span, f"mismatched '{found_text}': '{opener}' at {otok.line}:{otok.column} is still open",
                          "E005", help=f"close it with '{_CLOSER[opener]}' first")
    if found_text in _DECL_KEYWORDS and not at_end and tok.column > 1 and "NAME" in expected:
        # a declaration starts a line: one inside a line is the word used as a name
        return Diagnostic(span, f"'{tok}' is a reserved word and cannot be used as a name", "E001",
                          help="choose another name")
    terminator = at_end or found_text in _DECL_KEYWORDS or found_text in ("=>", "where")
    if terminator and ctx.open and _CLOSER[ctx.open[-1][0]] in expected:
        opener, otok = ctx.open[-1]
        return Diagnostic(Span(path, otok.line, otok.column, otok.end_line, otok.end_column),
                          f"'{opener}' was never closed", "E005",
                          help=f"add '{_CLOSER[opener]}' before {found} at {where}")
    if terminator and ctx.last in _NEEDS:
        return Diagnostic(span, f"expected {_NEEDS[ctx.last]} after '{ctx.last}', found {found}",
                          "E004" if at_end else "E001", help=_RULE_SHAPE)
    if found_text == "=" and "==" in expected and (ctx.in_where or "=>" not in expected):
        return Diagnostic(span, "'=' is not a comparison; write '=='", "E006",
                          help="conditions compare with ==, !=, <, <=, >, >=, in")
    if "=>" in expected and not ctx.in_where and "where" in expected:
        return Diagnostic(span, f"expected '=>' after the pattern, found {found}", "E007",
                          help=_keyword_hint(tok, expected) or _RULE_SHAPE)
    if "=>" in expected:
        return Diagnostic(span, f"expected '=>' after the condition, found {found}", "E007",
                          help=_keyword_hint(tok, expected) or _RULE_SHAPE)
    if ":" in expected and expected <= {":", "("}:
        name = f" '{ctx.rule_name}'" if ctx.rule_name else ""
        return Diagnostic(span, f"expected ':' after the rule name{name}, found {found}", "E008",
                          help=_RULE_SHAPE)
    if at_end:
        return Diagnostic(span, "unexpected end of file" + _expecting(expected), "E004")
    if str(tok) == "where" and ctx.in_replacement:
        return Diagnostic(span, "unexpected 'where' after the replacement", "E001",
                          help="the condition goes between the pattern and '=>': "
                               "rule name: PATTERN where CONDITION => REPLACEMENT")
    if tok.type != "NAME" and str(tok).isidentifier() and "NAME" in expected:
        return Diagnostic(span, f"'{tok}' is a reserved word and cannot be used as a name", "E001",
                          help="choose another name")
    return Diagnostic(span, f"unexpected {found}" + _expecting(expected), "E001",
                      help=_keyword_hint(tok, expected))


def _expecting(expected: set) -> str:
    salient = [e for e in _SALIENT if e in expected]
    if salient:
        shown = [f"'{e}'" for e in salient]
    elif len(expected) <= 6:
        shown = sorted(_DESCRIBE.get(e, f"'{e}'") for e in expected)
    else:
        return ""
    if len(shown) == 1:
        return f"; expected {shown[0]}"
    return f"; expected {', '.join(shown[:-1])} or {shown[-1]}"


def _keyword_hint(tok: object, expected: set) -> str | None:
    """Did-you-mean for a name that is a misspelled keyword (``wehre``)."""
    if getattr(tok, "type", None) != "NAME":
        return None
    keywords = [e for e in expected if e.isidentifier()]
    return did_you_mean(str(tok), keywords)


def _end_position(text: str) -> tuple:
    """Line and column just after the last character that is not blank or comment."""
    lines = text.split("\n")
    for i in range(len(lines) - 1, -1, -1):
        code = _strip_comment(lines[i]).rstrip()
        if code:
            return i + 1, len(code) + 1
    return 1, 1


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[:i]
    return line
