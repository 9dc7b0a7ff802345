"""The op vocabulary: canonical op names and every spelling of them in captured graphs.

See ``rewrite.ops.base`` for the data model and ``rewrite.ops.vocabulary`` for the
table. Adding an op means adding one entry to the table.
"""

from rewrite.ops.base import REQUIRED, Bound, ConstRef, OpDef, Param, node_key
from rewrite.ops.vocabulary import (
    bind_node,
    detect_dialect,
    forms_for_key,
    forms_for_node,
    in_vocabulary,
    lookup_op,
    mutates_input,
    op_refusal,
    op_names,
)

__all__ = [
    "REQUIRED", "Bound", "ConstRef", "OpDef", "Param", "node_key", "bind_node",
    "detect_dialect", "forms_for_key", "forms_for_node", "in_vocabulary", "lookup_op", "mutates_input", "op_names",
    "op_refusal",
]
