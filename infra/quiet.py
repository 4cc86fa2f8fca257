"""Library chatter silenced before the libraries load, so that a user error is one line on stderr.

Every package (data, decode, quantize, train) imports this first: transformers imports torchao, which logs a
warning for each CUDA-only extension a CPU build cannot load, and torchao makes a torch._pytree registration
that torch logs as deprecated. Neither concerns this project; both loggers still show their errors.
"""
import logging

for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
