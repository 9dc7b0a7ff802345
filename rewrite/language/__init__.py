"""The rule language front end: text -> checked ``Program``.

Stages, each in its own module, data flowing one way:

* ``parser``: Lark grammar (``grammar/rules.lark``) -> ``ast`` records with spans;
  ``syntax`` turns parse errors into friendly diagnostics;
* ``check``: names resolved against the op vocabulary and the function registry,
  arguments against op signatures, variables bound and used;
* ``program``: files and imports loaded, checked, combined into a ``Program``;
* ``diagnostics``: ``Diagnostic``, ``RuleError`` and their printed form;
* ``printer``: ``ast`` -> rule text (round-trips through the parser);
* ``format``: a rule file's text in canonical form, comments kept (``rewrite fmt``).

Example::

    >>> from rewrite.language import load_program_text
    >>> prog = load_program_text("rule mul_one: mul(x, 1) => x")
    >>> prog.rules[0].name
    'mul_one'
"""

from rewrite.language import ast
from rewrite.language.diagnostics import Diagnostic, RuleError, format_diagnostic
from rewrite.language.format import format_source
from rewrite.language.parser import parse_text
from rewrite.language.printer import format_expr, format_module, format_rule
from rewrite.language.program import Program, load_program, load_program_text

__all__ = [
    "ast", "parse_text", "load_program", "load_program_text", "Program", "RuleError",
    "Diagnostic", "format_diagnostic", "format_expr", "format_rule", "format_module", "format_source",
]
