"""Trust: why a rewrite may be believed.

``check`` compares the original and rewritten graphs by randomized execution;
``instances`` builds small programs a rule applies to; ``verify`` checks each rule
on them; ``explain`` says why a rule did or did not fire. ``rewrite.testing`` is the
public face of these for users' own test suites.
"""
