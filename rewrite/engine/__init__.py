"""The engine: compiled rules matched and applied to a graph.

Pipeline order: ``compile`` (resolved rules -> pattern trees, indexed by root op),
``prefilter`` (reject a node from its raw arguments), ``match`` (bind a pattern,
check ``where``), ``replace`` (emit the replacement in the graph's dialect),
``driver`` (schedules, worklist fixpoint), with ``facts`` (what a node is known to
be), ``aliasing`` (views and writes), ``workspace`` (the working copy) and
``leaves`` (ops hidden inside symbolic_trace leaf modules).
"""
