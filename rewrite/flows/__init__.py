"""Flows: rule sets composed into user-facing workflows.

``quant`` (post-training quantization: observe, calibrate, convert, lower; the
int8-kernel and QDQ forms, ONNX export), ``qat`` (quantization-aware training) and
``dynamo`` (rule sets as a ``torch.compile`` backend, before Inductor or as an Inductor
pass). Their public names are short: ``rewrite.quant``, ``rewrite.qat``,
``rewrite.backend``, ``rewrite.inductor_pass``, ``rewrite.freeze_parameters``.
"""
