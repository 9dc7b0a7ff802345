"""Flows: rule sets composed into user-facing workflows.

``quant`` (post-training quantization: observe, calibrate, convert, lower) and
``dynamo`` (rule sets as a ``torch.compile`` backend). Their public names are short:
``rewrite.quant`` and ``rewrite.backend``.
"""
